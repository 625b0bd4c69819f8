"""Bad config input: each case is refused before any work, in one line naming the key and what is valid.

103 inputs in `CASES` are checked in-process through `preflight`, the same function `parallama-train` runs before
Hydra starts (it composes the config as Hydra will, so typos, group options, sweeps and `--cfg` are covered);
tests/integration/test_bad_config_cli.py checks on the real command line that the line is all the user sees.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from parallama import CONF_DIR
from parallama.app.compose import preflight
from parallama.errors import ConfigError

CASES = [  # (overrides, what the one line must say)
    (["trainer.max_stepz=3"], "unknown config key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)"),
    # a key of another option of the group: name it (found: `+strategy.ep` was suggested, then refused otherwise)
    (
        ["model=qwen3_moe_tiny", "strategy.ep=2"],
        "unknown config key 'strategy.ep' for this strategy; it is a key of strategy=model_parallel",
    ),
    (["model.foo=1"], "unknown config key 'model.foo'; to add a new key write +model.foo=..."),
    (["+model.foo=1"], "model: LlamaConfig.__init__() got an unexpected keyword argument 'foo'"),
    (
        ["model=tinyy"],
        "model=tinyy is not an option of config group 'model'; valid: llama3_2_1b, llama3_70b, llama3_8b",
    ),
    (["strategy=zero"], "strategy=zero is not an option of config group 'strategy'; valid: auto, ddp"),
    (["debug=fast"], "debug=fast is not an option of config group 'debug'"),
    (["logger=mlflow"], "logger=mlflow is not an option of config group 'logger'"),
    (["experiment=nonexistent"], "experiment=nonexistent is not an option of config group 'experiment'"),
    (["data/source=files"], "data.source.paths is required"),
    (["model.num_attention_heads=3"], "model.num_attention_heads=3 must divide model.hidden_size=128"),
    (["model.num_key_value_heads=3"], "model.num_key_value_heads=3 must divide model.num_attention_heads=4"),
    (["model.hidden_size=-128"], "model.hidden_size=-128 must be a positive int"),
    (["model.rms_norm_eps=-1"], "model.rms_norm_eps=-1 must be > 0"),
    (["model.rope_theta=0"], "model.rope_theta=0 must be > 0"),
    (["model=qwen3_tiny", "model.head_dim=47"], "model.head_dim=47 must be even (rope)"),
    (["+model.head_dim=48"], "LlamaConfig.__init__() got an unexpected keyword argument 'head_dim'"),
    (["data.seq_len=4096"], "data.seq_len=4096 exceeds model.max_position_embeddings=1024"),
    (["data.seq_len=0"], "data.seq_len=0 is not valid; use an integer >= 1"),
    (["data.batch_size=0"], "data.batch_size=0 is not valid; use an integer >= 1"),
    (["data.packing=maybe"], "data.packing='maybe' is not valid; use true or false"),
    (["data.val_fraction=1"], "data.val_fraction=1 is not valid; use a number in [0, 1)"),
    (["data.val_fraction=-0.1"], "data.val_fraction=-0.1 is not valid"),
    (["data.num_workers=-1"], "data.num_workers=-1 is not valid; use an integer >= 0"),
    (
        ["data.source.max_documents=0"],
        "data.source.max_documents=0 is not valid; use an integer >= 1 or null",
    ),
    (["data.source.corpus=poetry"], "data.source.corpus='poetry' is not valid; use one of 'prose', 'code'"),
    (
        ["tokenizer=bpe", "tokenizer.vocab_size=100"],
        "tokenizer.vocab_size=100 is not valid; use an integer >= 260",
    ),
    (["trainer.max_steps=abc"], "trainer.max_steps='abc' is not valid; use an integer >= 1 or -1"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 is not valid"),
    (["trainer.max_epochs=0"], "trainer.max_epochs=0 is not valid"),
    (["trainer.num_nodes=0"], "trainer.num_nodes=0 is not valid; use an integer >= 1"),
    (["trainer.devices=0"], "trainer.devices=0 is not valid; use a count (e.g. 2), auto, or device ids"),
    (
        ["trainer.accumulate_grad_batches=-2"],
        "trainer.accumulate_grad_batches=-2 is not valid; use an integer >= 1",
    ),
    (
        ["trainer.gradient_clip_val=-1"],
        "trainer.gradient_clip_val=-1 is not valid; use a number >= 0 or null",
    ),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0 is not valid; use an integer >= 1"),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval=0 is not valid; use a number > 0 or null"),
    (["trainer.limit_val_batches=-1"], "trainer.limit_val_batches=-1 is not valid"),
    (["trainer.limit_train_batches=0"], "trainer.limit_train_batches=0 is not valid"),
    (["trainer.overfit_batches=-1"], "trainer.overfit_batches=-1 is not valid"),
    (["trainer.fast_dev_run=-1"], "trainer.fast_dev_run=-1 is not valid"),
    (["trainer.num_sanity_val_steps=-2"], "trainer.num_sanity_val_steps=-2 is not valid"),
    (["trainer.precision=bf17"], "trainer.precision='bf17' is not valid; use one of '32-true'"),
    (["trainer.accelerator=tpu"], "trainer.accelerator='tpu' is not valid; use one of 'auto', 'cpu', 'gpu'"),
    (["trainer.deterministic=sometimes"], "trainer.deterministic='sometimes' is not valid"),
    (["seed=-1"], "seed=-1 is not valid; use an integer >= 0"),
    (["seed=abc"], "seed='abc' is not valid"),
    (["global_batch_size=50", "data.batch_size=16"], "global_batch_size=50 is not a multiple of"),
    (["global_batch_size=0"], "global_batch_size=0 is not valid; use an integer >= 1 or null"),
    (["global_batch_size=32", "trainer.accumulate_grad_batches=4"], "set only one of them"),
    (
        ["data.batch_size=null"],
        "data.batch_size=null takes its micro-batch from global_batch_size, which is null",
    ),
    (
        ["data.batch_size=null", "global_batch_size=63", "trainer.accelerator=cpu", "trainer.devices=2"],
        "data.batch_size=null splits global_batch_size=63 over 2 data-parallel replica(s), which does not divide",
    ),
    (["optimizer.lr=5"], "optimizer.lr=5 is not valid; use a number in (0, 1]"),
    # found as tracebacks (a ValueError in distributed/dims.py; 'int' has no total_seconds after training started)
    (
        ["trainer.devices=abc"],
        "trainer.devices='abc' is not valid; use a count (e.g. 2), auto, or device ids",
    ),
    (["trainer.devices=[]"], "trainer.devices=[] is not valid; use a count"),
    (
        ["callbacks.last_checkpoint.train_time_interval=30"],
        "callbacks.last_checkpoint.train_time_interval=30 is not valid; use null or a duration",
    ),
    (["optimizer.lr=0"], "optimizer.lr=0 is not valid"),
    (["optimizer.lr=fast"], "optimizer.lr='fast' is not valid"),
    (["optimizer.weight_decay=-1"], "optimizer.weight_decay=-1 is not valid; use a number >= 0"),
    (["optimizer.eps=0"], "optimizer.eps=0 is not valid; use a number > 0"),
    (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9] is not valid; use two numbers in [0, 1)"),
    (["optimizer.betas=[0.9,1.5]"], "optimizer.betas=[0.9, 1.5] is not valid"),
    (["optimizer.fused=perhaps"], "optimizer.fused='perhaps' is not valid; use true or false or null"),
    (["scheduler.warmup_steps=700"], "scheduler.warmup_steps=700 is not below trainer.max_steps=500"),
    (["scheduler.warmup_steps=-1"], "scheduler.warmup_steps=-1 must be an integer >= 0 or auto"),
    (["scheduler.warmup_steps=soon"], "scheduler.warmup_steps='soon' must be an integer >= 0 or auto"),
    (["scheduler.min_lr_ratio=2"], "scheduler.min_lr_ratio=2 is not valid; use a number in [0, 1]"),
    (["scheduler.warmup_start_factor=-0.5"], "scheduler.warmup_start_factor=-0.5 is not valid"),
    (["sample.max_new_tokens=-5"], "sample.max_new_tokens=-5 is not valid; use an integer >= 0"),
    (["sample.temperature=-1"], "sample.temperature=-1 is not valid; use a number >= 0"),
    (["sample.top_k=0"], "sample.top_k=0 is not valid; use an integer >= 1 or null"),
    (["compile=yes"], "compile='yes' is not valid; use one of 'auto' or true or false"),
    (
        ["float8=tensorwise", "float8_filter=some"],
        "float8_filter='some' is not valid; use one of 'auto', 'all'",
    ),
    (
        ["activation_checkpointing=2"],
        "activation_checkpointing=2 is not valid; use one of 'none', 'full', 'selective' or true or false",
    ),
    (["activation_checkpointing=some"], "activation_checkpointing='some' is not valid; use one of 'none'"),
    (
        ["activation_checkpointing_policy.mode=half"],
        "activation_checkpointing_policy.mode='half' is not valid; use one of 'op', 'every_n'",
    ),
    (
        ["activation_checkpointing_policy.every_n=0"],
        "activation_checkpointing_policy.every_n=0 is not valid; use an integer >= 1",
    ),
    (["float8=fp4"], "float8='fp4' is not valid; use one of 'tensorwise', 'rowwise' or null"),
    (
        ["float8=tensorwise", "float8_filter=all", "model.intermediate_size=200"],
        "float8=tensorwise: layers.0.mlp.gate_proj is 128 -> 200, float8 matmuls need both multiples of 16",
    ),
    (["float8=rowwise", "strategy=deepspeed"], "float8=rowwise is not supported under strategy=deepspeed"),
    # a part of yours that does not import: its key, before the job prints its config
    (
        ["+callbacks.mine._target_=nope.Nope"],
        "callbacks.mine._target_=nope.Nope cannot be imported (No module named",
    ),
    (
        ["logger.csv._target_=parallama.training.loggers.Nope"],
        "logger.csv._target_=parallama.training.loggers.Nope",
    ),
    (["strategy._target_=mystrategy.Mine"], "strategy._target_=mystrategy.Mine cannot be imported"),
    (
        ["float8=rowwise", "trainer.inference_mode=true"],
        "trainer.inference_mode=true cannot run float8=rowwise",
    ),
    (["validate_before_training=maybe"], "validate_before_training='maybe' is not valid"),
    (["callbacks.last_checkpoint.every_n_train_steps=0"], "callbacks.last_checkpoint.every_n_train_steps=0"),
    (["logger=wandb", "logger.wandb.mode=sometimes"], "logger.wandb.mode='sometimes' is not valid"),
    (["strategy=deepspeed", "strategy.stage=4"], "strategy.stage=4 is not valid; use one of 1, 2, 3"),
    (
        ["strategy=deepspeed", "strategy.offload_optimizer=maybe"],
        "strategy.offload_optimizer='maybe' is not valid",
    ),
    (["strategy=fsdp", "strategy.mixed_precision=int8"], "strategy.mixed_precision='int8' is not valid"),
    (["strategy=fsdp", "strategy.reshard_after_forward=2"], "strategy.reshard_after_forward=2 is not valid"),
    (
        ["strategy=ddp", "strategy.process_group_backend=mpi"],
        "strategy.process_group_backend='mpi' is not valid",
    ),
    (["strategy=ddp", "strategy.bucket_cap_mb=0"], "strategy.bucket_cap_mb=0 is not valid; use a number > 0"),
    # keys the string-keyed table did not have, now fields of config/schema.py
    (["trainer.benchmark=maybe"], "trainer.benchmark='maybe' is not valid; use true or false"),
    (
        ["trainer.check_val_every_n_epoch=0"],
        "trainer.check_val_every_n_epoch=0 is not valid; use an integer >= 1",
    ),
    (
        ["strategy=model_parallel", "strategy.pp_schedule=zigzag"],
        "strategy.pp_schedule='zigzag' is not valid; use one of 'gpipe', '1f1b'",
    ),
    (
        ["data/source=hub", "data.source.name=x", "data.source.streaming=perhaps"],
        "data.source.streaming='perhaps' is not valid; use true or false",
    ),
    (["logger=wandb", "logger.wandb.log_model=sometimes"], "logger.wandb.log_model='sometimes' is not valid"),
    (
        ["strategy=fsdp", "strategy.save_distributed_checkpoint=2"],
        "strategy.save_distributed_checkpoint=2 is not",
    ),
    # Hydra's own flags: a sweep is checked job by job, --cfg like a run
    (
        ["-m", "optimizer.lr=1e-3,2"],
        "optimizer.lr=2 is not valid; use a number in (0, 1] (in the sweep job with",
    ),
    (["-m", "model=tiny,tinyy"], "model=tinyy is not an option of config group 'model'"),
    (["--multirun", "trainer.max_stepz=1,2"], "unknown config key 'trainer.max_stepz'"),
    (["--cfg", "job", "trainer.max_stepz=1"], "unknown config key 'trainer.max_stepz'"),
    # a sweep's values without -m (Hydra's "Ambiguous value" in 6 lines and exit status 1): -m is all it lacks
    (
        ["optimizer.lr=1e-3,5"],
        "optimizer.lr=1e-3,5 is a sweep over several values: add -m to run one job per value "
        "(or write optimizer.lr=[1e-3,5] for a list, optimizer.lr='1e-3,5' for a string)",
    ),
    (["model=glob(tin*)"], "model=glob(tin*) is a sweep: add -m to run one job per value"),
    (
        ["hparams_search=lr_optuna", "--cfg", "job", "model.hidden_size=64,128"],
        "model.hidden_size=64,128 is a sweep but --cfg prints one config",
    ),
    (["-c", "all", "data.packing=maybe"], "data.packing='maybe' is not valid"),
]
ON_CPU_ONLY = [
    (
        ["float8=tensorwise", "strategy=model_parallel", "strategy.tp=2", "strategy.sequence_parallel=true"],
        "float8=tensorwise with strategy.sequence_parallel=true needs GPUs",
    ),
    (
        ["strategy=ddp", "strategy.process_group_backend=nccl"],
        "strategy.process_group_backend=nccl needs GPUs",
    ),
    (["strategy=fsdp", "strategy.mixed_precision=fp16"], "strategy.mixed_precision=fp16 needs GPUs"),
    (["trainer.accelerator=gpu"], "trainer.accelerator=gpu but no GPU is visible"),
    ([f"trainer.devices={2 * (os.cpu_count() or 1) + 1}"], "CPU processes but this machine has"),
]


def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        preflight(CONF_DIR, "train", overrides)
    return str(err.value)


def test_there_are_at_least_60_cases():
    assert len(CASES) + len(ON_CPU_ONLY) >= 60


@pytest.mark.parametrize("overrides, message", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_bad_input_is_one_line_naming_the_key(overrides, message):
    text = refusal(overrides)
    assert message in text
    assert "\n" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the messages for a machine without a GPU")
@pytest.mark.parametrize("overrides, message", ON_CPU_ONLY, ids=[" ".join(o) for o, _ in ON_CPU_ONLY])
def test_gpu_settings_on_a_cpu_machine(overrides, message):
    text = refusal(overrides)
    assert message in text and "\n" not in text


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.max_steps=5"],  # a smoke test: the default warmup (auto) shrinks to fit
        ["activation_checkpointing=selective", "activation_checkpointing_policy.mode=every_n"],
        ["activation_checkpointing=true"],
        ["float8=rowwise"],
        ["trainer.fast_dev_run=true"],
        ["debug=fdr"],
        ["debug=limit"],
        ["logger=none"],
        ["-m", "optimizer.lr=1e-3,3e-3"],
        ["--cfg", "job", "data/source=files"],  # printing a config that still needs a value is fine
        ["hparams_search=lr_optuna"],
        ["trainer.val_check_interval=0.5"],  # a fraction of an epoch: check_val_every_n_epoch=1 follows
        ["hparams_search=lr_optuna", "model.hidden_size=64,128"],  # the preset asks for a sweep: no -m needed
        ["--help"],
    ],
)
def test_good_input_passes(overrides):
    preflight(CONF_DIR, "train", overrides)


def jupyter_advice() -> list[list[str]]:
    """The command lines docs/strategies.md's "DDP under Jupyter" advice gives (each `...=...` in backticks)."""
    text = (Path(__file__).parents[2] / "docs" / "strategies.md").read_text()
    advice = text.split("- **DDP under Jupyter**", 1)[1].split("\n- **", 1)[0]
    return [code.split() for code in re.findall(r"`([^`<]*=[^`<]*)`", advice)]  # not `strategy=<name>`


def test_the_documented_notebook_commands_compose():
    """It advised `strategy.name=ddp_notebook`, which is an unknown config key."""
    commands = jupyter_advice()
    assert ["strategy=ddp_spawn", "trainer.devices=2"] in commands and ["trainer=ddp_sim"] in commands
    for command in commands:
        preflight(CONF_DIR, "train", command)


def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path):
    """Found: NotADirectoryError from data/parts.py once the tokenizer was trained."""
    file = tmp_path / "cache"
    file.write_text("")
    with pytest.raises(ConfigError, match=rf"^paths.cache_dir={file} is a file; give a folder"):
        preflight(CONF_DIR, "train", [f"paths.cache_dir={file}"])
    for devices in ("2", "'0,1'", "[0,1]", "auto"):  # the forms trainer.devices takes
        preflight(CONF_DIR, "train", ["trainer.accelerator=cpu", f"trainer.devices={devices}"])


def test_fp16_on_a_cpu_is_recorded_as_the_bf16_that_runs():
    """Found: `trainer.precision=16-mixed` on a CPU ran as bf16-mixed while resolved_config.yaml said 16-mixed."""
    from hydra import compose, initialize_config_dir

    from parallama.app.checks import check_config

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["trainer.accelerator=cpu", "trainer.precision=16-mixed"])
    check_config(cfg)
    assert cfg.trainer.precision == "bf16-mixed"


def test_a_run_dir_that_cannot_be_created_is_one_line(tmp_path):
    """Found: `hydra.run.dir=/proc/x` was a FileNotFoundError traceback, printed twice."""
    file = tmp_path / "a-file"
    file.write_text("")
    for path, reason in [("/proc/x", "No such file or directory"), (f"{file}/run", f"{file} is a file")]:
        with pytest.raises(ConfigError, match=rf"^hydra.run.dir={path} cannot be created \(.*{reason}"):
            preflight(CONF_DIR, "train", [f"hydra.run.dir={path}"])
    preflight(CONF_DIR, "train", [f"hydra.run.dir={tmp_path}/new/run"])  # a folder it can make
    assert not (tmp_path / "new").exists()  # made and removed: Hydra makes the run's own


def test_wandb_online_without_an_api_key_is_one_line(tmp_path, monkeypatch):
    """Found: a UsageError traceback from wandb.init, after the run directory existed."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no `wandb login` netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match=r"^W&B online \(logger.wandb.mode or WANDB_MODE\) but no API key"):
        preflight(CONF_DIR, "train", ["logger=wandb"])
    preflight(CONF_DIR, "train", ["logger=wandb", "logger.wandb.mode=offline"])
    monkeypatch.delenv("WANDB_MODE")
    preflight(CONF_DIR, "train", ["logger=wandb"])  # auto: offline without a key


YOUR_STRATEGIES = """
from parallama.parallel.strategies.ddp import DDP
from parallama.parallel.strategies.deepspeed import DeepSpeed


class MyDDP(DDP):
    pass


class MyDeepSpeed(DeepSpeed):
    pass
"""


@pytest.mark.parametrize(
    "overrides, yours, message",
    [
        (["strategy=ddp", "strategy.bucket_cap_mb=0"], "MyDDP", "strategy.bucket_cap_mb=0 is not valid"),
        (["strategy=deepspeed", "strategy.stage=4"], "MyDeepSpeed", "strategy.stage=4 is not valid"),
        (["strategy=deepspeed", "optimizer=muon"], "MyDeepSpeed", "optimizer=muon cannot run under"),
        (["strategy=deepspeed", "float8=rowwise"], "MyDeepSpeed", "float8=rowwise is not supported under"),
        (
            ["strategy=deepspeed", "strategy.offload_optimizer=true", "optimizer._target_=torch.optim.NAdam"],
            "MyDeepSpeed",
            "strategy.offload_optimizer=true steps with DeepSpeed's CPU Adam",
        ),
    ],
    ids=["ddp-key", "deepspeed-key", "deepspeed-muon", "deepspeed-float8", "deepspeed-offload"],
)
def test_a_strategy_of_yours_is_checked_as_the_class_it_extends(
    tmp_path, monkeypatch, overrides, yours, message
):
    """A strategy's keys and refusals are its class's (`config_keys`, `refusal`): a subclass of yours named in
    `strategy._target_` gets the shipped class's line (the table they replaced was keyed by the shipped names)."""
    (tmp_path / "your_strategies.py").write_text(YOUR_STRATEGIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "your_strategies", raising=False)
    shipped = refusal(overrides)
    assert message in shipped
    assert refusal([*overrides, f"strategy._target_=your_strategies.{yours}"]) == shipped


YOUR_SOURCES = """
from dataclasses import dataclass

from parallama.data.sources import EmbeddedKeys, embedded
from parallama.rules import Rule, key


def prose(corpus="prose", max_documents=None):
    return embedded(corpus, max_documents)


prose.config_keys = EmbeddedKeys  # the shipped source's keys


@dataclass
class TopicKeys:
    topic: str = key("all", Rule(str, choices=("all", "python")))
    max_documents: int | None = key(None, Rule(int, 1, allow=(None,)))


def topics(topic="all", max_documents=None):
    return embedded("prose", max_documents)


topics.config_keys = TopicKeys  # keys of its own
"""


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["data.source.max_documents=0"],
            "data.source.max_documents=0 is not valid; use an integer >= 1 or null",
        ),
        (
            ["data.source.corpus=poetry"],
            "data.source.corpus='poetry' is not valid; use one of 'prose', 'code'",
        ),
        (
            ["experiment=mixture", "data.sources.code.source.max_documents=0"],
            "data.sources.code.source.max_documents=0 is not valid; use an integer >= 1 or null",
        ),
    ],
    ids=["max_documents", "corpus", "mixture"],
)
def test_a_data_source_of_yours_is_checked_by_the_keys_it_declares(tmp_path, monkeypatch, overrides, line):
    """A data source's keys are its function's (`config_keys`), whatever its `_target_`: a function of yours
    that declares them gets the shipped source's line (the table they replaced was keyed by the shipped names)."""
    (tmp_path / "your_sources.py").write_text(YOUR_SOURCES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "your_sources", raising=False)
    assert refusal(overrides) == line
    node = "data.sources.code.source" if "experiment=mixture" in overrides else "data.source"
    assert refusal([*overrides, f"{node}._target_=your_sources.prose"]) == line


def test_a_data_source_of_yours_states_keys_of_its_own(tmp_path, monkeypatch):
    (tmp_path / "your_sources.py").write_text(YOUR_SOURCES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "your_sources", raising=False)
    yours = ["data.source._target_=your_sources.topics", "~data.source.corpus", "+data.source.topic=python"]
    preflight(CONF_DIR, "train", yours)
    assert refusal([*yours, "data.source.topic=poetry"]) == (
        "data.source.topic='poetry' is not valid; use one of 'all', 'python'"
    )


YOUR_TRAINER = """
import lightning as L


class MyTrainer(L.Trainer):
    def __init__(self, patience: int = 3, **kwargs):
        super().__init__(**kwargs)
"""


def test_a_trainer_of_yours_is_checked_by_its_own_arguments(tmp_path, monkeypatch):
    """`trainer._target_` a class of yours: a key neither it nor Lightning's Trainer (where it passes **kwargs
    on) takes is one line, with the closest of either."""
    (tmp_path / "your_trainer.py").write_text(YOUR_TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "your_trainer", raising=False)
    yours = ["trainer._target_=your_trainer.MyTrainer", "+trainer.patience=5", "trainer.accelerator=cpu"]
    preflight(CONF_DIR, "train", yours)
    for typo, meant in [("patiense", "patience"), ("max_stepz", "max_steps")]:
        assert refusal([*yours, f"+trainer.{typo}=1"]) == (
            f"unknown config key 'trainer.{typo}' (did you mean 'trainer.{meant}'?): "
            f"your_trainer.MyTrainer has no argument {typo!r}"
        )
