"""Bad config input on the real command line: the one `error:` line and exit status 2 are all the user sees
(the cases themselves are checked in-process in tests/unit/test_bad_config.py)."""

from __future__ import annotations

import os

import pytest
from conftest import run_cli


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["trainer.max_stepz=3"],
            "error: unknown config key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)",
        ),
        (["-m", "optimizer.lr=1e-3,2"], "error: optimizer.lr=2 is not valid"),
        (["optimizer.lr=1e-3,2e-3"], "error: optimizer.lr=1e-3,2e-3 is a sweep over several values: add -m"),
        (["--cfg", "job", "data.packing=maybe"], "error: data.packing='maybe' is not valid"),
        # raised inside a constructor Hydra instantiates: still one line, naming the key
        (
            ["+callbacks.progress_bar.bogus=1"],
            "error: callbacks.progress_bar: progress_bar() got an unexpected keyword argument 'bogus'",
        ),
        # a layout tensor parallelism cannot split (more in tests/unit/test_model_parallel_config.py)
        (
            ["strategy=model_parallel", "trainer.devices=2", "strategy.tp=2", "model.num_key_value_heads=1"],
            "error: strategy.tp=2 must divide model.num_key_value_heads=1 (each tp rank takes 1/tp of it)",
        ),
    ],
)
def test_cli_prints_one_line_and_exits_2(tmp_path, args, message):
    proc = run_cli(
        "parallama.cli.train", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert message in out
    assert "Traceback" not in out and "Error executing job" not in out
    assert len([line for line in out.splitlines() if "error:" in line]) == 1


# The files a run reads and a new trainer key are checked in the preflight: one line, before the config dump,
# the banners or the run directory (before: ~7 s and ~150 lines of output to the same line).
@pytest.mark.parametrize(
    "args, message",
    [
        (["ckpt_path=/nonexistent/last.ckpt"], "ckpt_path=/nonexistent/last.ckpt does not exist"),
        (
            ["data/source=files", "data.source.paths=/nonexistent/*.jsonl"],
            "data.source.paths='/nonexistent/*.jsonl' matches no file",
        ),
        (
            [
                "experiment=mixture",
                "+data/source@data.sources.web.source=files",
                "+data.sources.web.weight=1",
                "data.sources.web.source.paths=/nonexistent/*.txt",
            ],
            "data.sources.web: data.source.paths='/nonexistent/*.txt' matches no file",
        ),
        (["init_from={tmp}"], "init_from={tmp} has no config.json; expected a Hugging Face llama folder"),
        (
            ["ckpt_path={ckpt}"],  # the default model is 128 wide
            "ckpt_path={ckpt} was trained with model.hidden_size=64 but this run has model.hidden_size=128",
        ),
        (
            ["+trainer.max_stepz=100"],
            "unknown config key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)",
        ),
        # found printing the whole config first and leaving an empty run directory
        (["ckpt_path=last"], "ckpt_path=last: this run's directory {run} has no checkpoint (looked for "),
        (
            ["tokenizer=pretrained", "tokenizer.name_or_path=/nonexistent/tokenizer"],
            "tokenizer.name_or_path: no tokenizer file at '/nonexistent/tokenizer'",
        ),
        (["model.vocab_size=100"], "the tokenizer has 260 tokens but model.vocab_size=100"),
    ],
    ids=[
        *("ckpt_path", "glob", "mixture-glob", "init_from", "resume-other-size", "new-trainer-key"),
        *("resume-no-run", "tokenizer-path", "vocab-below-tokenizer"),
    ],
)
def test_inputs_are_checked_before_any_work(tmp_path, tiny_run, args, message):
    ckpt = tiny_run.dir / "checkpoints" / "last.ckpt"
    run = tmp_path / "run"
    fill = {"tmp": tmp_path, "ckpt": ckpt, "run": run}
    proc = run_cli(
        "parallama.cli.train",
        "trainer.accelerator=cpu",
        *[arg.format(**fill) for arg in args],
        f"hydra.run.dir={run}",
        cwd=tmp_path,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert out.strip().splitlines() == [out.strip()] and out.startswith("error: "), out[-3000:]
    assert message.format(**fill) in out
    assert not run.exists() and not (tmp_path / "logs").exists()  # nothing was built or written


def test_a_changed_search_on_an_existing_study_is_one_line(tmp_path):
    """Found: a 16-line traceback ending in `ConfigError: study 'lr' ...` and exit status 1 (Hydra prints the
    exceptions of a sweeper): a sweeper's refusal is one line and exit status 2, before any trial runs."""
    import optuna

    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="lr", storage=storage)
    study.set_user_attr("settings", ["trainer.max_steps=10"])
    study.ask({"optimizer.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)})
    args = ["hparams_search=lr_optuna", "trainer.accelerator=cpu", "trainer.max_steps=30"]
    args += [f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=lr"]
    proc = run_cli("parallama.cli.train", *args, cwd=tmp_path, check=False)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, out[-3000:]
    assert out.splitlines() == [out] and out.startswith(
        f"error: study 'lr' in {storage}: its trials ran with"
    ), out
    assert "this command has" in out and "hydra.sweeper.other_settings=true" in out


def test_a_strategy_of_yours_gets_the_line_of_the_class_it_extends(tmp_path):
    """Its keys are checked by the class it extends (`config_keys`), as `strategy=ddp`'s own: the same line and
    status (more cases, in-process: tests/unit/test_bad_config.py)."""
    (tmp_path / "mymod.py").write_text(
        "from parallama.parallel.strategies.ddp import DDP\n\n\nclass MyDDP(DDP):\n    pass\n"
    )
    args = [
        "strategy=ddp",
        "strategy._target_=mymod.MyDDP",
        "strategy.bucket_cap_mb=-1",
        "trainer.accelerator=cpu",
    ]
    run = tmp_path / "run"
    proc = run_cli(
        "parallama.cli.train",
        *args,
        f"hydra.run.dir={run}",
        cwd=tmp_path,
        env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
        check=False,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2, out[-3000:]
    assert out == "error: strategy.bucket_cap_mb=-1 is not valid; use a number > 0"
    assert not run.exists()
