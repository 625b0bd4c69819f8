"""`parallama-eval ckpt_path=<checkpoint> [split=val|train] [max_batches=N] [json=true] [device=...] [data.*=...]`:
loss and perplexity of a checkpoint of any strategy, in one process, through `trainer.validate` with parallama's
LightningModule (as lightning-hydra-template's eval.py; the `trainer` group configures it). With `tasks=[...]`
(and `ckpt_path=` or `model_dir=<exported folder>`): lm-evaluation-harness scores (`evaluation.harness`).
A Hydra app (conf/eval.yaml).

The data is the run's own: plain values of `data.*` in the resolved_config.yaml next to `checkpoints/` (else
conf/data), with the command line's data overrides on top (`data/source=files data.source.paths=...`
switches the source), tokenized by the tokenizer stored in the checkpoint. Same seed and val_fraction ->
same held-out documents. That file travels with the checkpoint, so only parallama's own data classes are
instantiated from it.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from parallama import CONF_DIR
from parallama.cli import app
from parallama.config.parts import targets
from parallama.errors import ConfigError
from parallama.rules import Rule, check_keys, key

DATA_CONF = CONF_DIR / "data"


def allowed_targets() -> set[str]:
    """What parallama-eval instantiates from a run's config: the `_target_`s of the shipped data configs (the
    data module, every data/source and every tokenizer), so a new source's config file extends it by itself."""
    files = [
        DATA_CONF / "default.yaml",
        *DATA_CONF.glob("source/*.yaml"),
        *(CONF_DIR / "tokenizer").glob("*.yaml"),
    ]
    return {target for f in files if (target := OmegaConf.load(f).get("_target_"))}


def check_targets(node, where: str, key: str = "data") -> None:
    """Refuse any `_target_` that is not one of parallama's data classes (Hydra would import and call it)."""

    allowed = allowed_targets()
    for path, target in targets(node, key):
        if target not in allowed:
            raise ConfigError(
                f"{where} has {path}._target_={target}, which parallama-eval does not instantiate; "
                f"allowed: {', '.join(sorted(allowed))}"
            )


def data_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The run's data with the command line's `data.*` / `data/...` overrides (their composed values) on top."""

    from parallama.checkpoint.read import run_config, run_config_path  # torch-free module

    run = run_config(cfg.ckpt_path)
    if run is None or "data" not in run:
        print(
            f"no run config beside {cfg.ckpt_path} ({run_config_path(cfg.ckpt_path)}): evaluating on the "
            "eval config's data (conf/eval.yaml's data group, with the command line's data.* overrides) and the "
            "checkpoint's own tokenizer",
            file=sys.stderr,  # stdout is the result (json=true)
        )
        return cfg.data
    check_targets(OmegaConf.to_container(run.data), str(run_config_path(cfg.ckpt_path)))
    data = run.data
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group.replace("/", ".")
        if key == "data":
            data = cfg.data
        elif key.startswith("data."):
            sub = key.removeprefix("data.")
            if override.is_delete():
                parent, _, leaf = sub.rpartition(".")
                (OmegaConf.select(data, parent) if parent else data).pop(leaf, None)
            else:
                OmegaConf.update(data, sub, OmegaConf.select(cfg, key), merge=False)
    return data


def evaluate(cfg: DictConfig, overrides: list[str] = ()) -> dict:
    """`overrides`: the command line's, so that the `data.*` ones apply on top of the run's own data."""
    result = downstream(cfg) if cfg.tasks else loss_and_perplexity(cfg, overrides)
    if cfg.out is not None:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def loss_and_perplexity(cfg: DictConfig, overrides: list[str]) -> dict:
    """trainer.validate of parallama's LightningModule, holding the checkpoint's weights, on the data split."""
    import lightning as L  # torch-free module
    import torch  # torch-free module

    from parallama.checkpoint.read import load_checkpoint, load_state_into  # torch-free module
    from parallama.data.index import save_atomic  # start-up time (tokenizers)
    from parallama.training.callbacks import ValidationTokens  # torch-free module
    from parallama.training.module import CausalLM  # torch-free module

    data = data_config(cfg, overrides)
    ckpt = load_checkpoint(cfg.ckpt_path)
    if ckpt.tokenizer_json is not None:  # a stable file name keeps the tokenized-corpus cache key stable
        digest = hashlib.sha256(ckpt.tokenizer_json.encode()).hexdigest()[:16]
        tok_file = Path(data.cache_dir, f"tokenizer-ckpt-{digest}.json")
        tok_file.parent.mkdir(parents=True, exist_ok=True)
        # whole or not at all: ranks may write it at once
        save_atomic(str(tok_file), lambda f: f.write(ckpt.tokenizer_json.encode()))
        data.tokenizer = {
            "_target_": "parallama.tokenizer.from_pretrained",
            "_partial_": True,
            "name_or_path": str(tok_file),
        }
    data = OmegaConf.to_container(data, resolve=True)
    check_targets(data, "the data config")
    datamodule = hydra.utils.instantiate(data)
    datamodule.setup()
    loader = datamodule.val_dataloader() if cfg.split == "val" else datamodule.train_dataloader()

    hparams = ckpt.meta["hyper_parameters"]
    module = CausalLM(hparams["model"], hparams.get("optimizer", {}), hparams.get("scheduler", {}))
    module.model = ckpt.spec.model(ckpt.config)  # built here: configure_model keeps it
    load_state_into(module.model, ckpt.state_dict, source=f"checkpoint {cfg.ckpt_path}")
    tokens = ValidationTokens()
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer, callbacks=[tokens], limit_val_batches=cfg.max_batches or 1.0, **device_args(cfg.device)
    )
    trainer.validate(module, dataloaders=loader, verbose=False)
    if tokens.count == 0:
        raise ConfigError(
            f"split={cfg.split} has no tokens to evaluate (raise data.val_fraction or max_batches)"
        )
    loss = float(trainer.callback_metrics["val/loss"].to(torch.float64))
    result = {"loss": loss, "ppl": math.exp(loss), "tokens": tokens.count, "split": cfg.split}
    if cfg.json:
        print(json.dumps(result))
    else:
        print(f"loss={loss:.4f} ppl={math.exp(loss):.3f} tokens={tokens.count}")
    return result


def device_args(device: str | None) -> dict:
    """`device=cuda:1` as Trainer arguments (null: the trainer config's)."""
    if device is None:
        return {}
    kind, _, index = device.partition(":")
    return {"accelerator": "cpu" if kind == "cpu" else "gpu", "devices": [int(index)] if index else 1}


def downstream(cfg: DictConfig) -> dict:
    """lm-evaluation-harness scores of the checkpoint or exported folder: {task: {metric: value}}."""
    from parallama.evaluation.harness import evaluate, task_manager  # torch-free module
    from parallama.evaluation.lm import ParallamaLM  # torch-free module

    task_manager(list(cfg.tasks), cfg.paths.cache_dir, cfg.task_dirs)  # a bad name: before loading the model
    lm = ParallamaLM(
        ckpt_path=cfg.ckpt_path, model_dir=cfg.model_dir, batch_size=cfg.batch_size, device=cfg.device
    )
    table = evaluate(
        lm, list(cfg.tasks), cache_dir=cfg.paths.cache_dir, task_dirs=cfg.task_dirs, limit=cfg.limit
    )
    if cfg.json:
        print(json.dumps(table))
    else:
        for task, metrics in table.items():
            print(task, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
    return table


def source_alias(argv: list[str]) -> list[str]:
    """`data.source=<name>` (the older spelling) means the config group choice `data/source=<name>`."""
    args = []
    for arg in argv:
        if arg.startswith("data.source="):
            name = arg.removeprefix("data.source=")
            if not (DATA_CONF / "source" / f"{name}.yaml").is_file():
                names = sorted(p.stem for p in (DATA_CONF / "source").glob("*.yaml"))
                raise ConfigError(f"{arg} is not a source; valid: {', '.join(names)}")
            arg = f"data/source={name}"
        args.append(arg)
    return args


@dataclass
class Evaluate:
    """The tool's own keys (beside the data, tokenizer, trainer and paths groups it shares with training), their
    defaults and valid values (rules.py `key`)."""

    conf: ClassVar[str] = "eval.yaml"

    task_name: str = key("eval")
    seed: int = key(42, Rule(int, 0))
    ckpt_path: str | None = key(None)
    model_dir: str | None = key(None)
    split: str = key("val", Rule(str, choices=("val", "train")))
    max_batches: int | None = key(None, Rule(int, 1, allow=(None,)))
    json: bool = key(False, Rule(bool))
    device: str | None = key(None)
    tasks: list = key([])
    task_dirs: list = key([])
    limit: int | float | None = key(None, Rule(float, 0, open="low", allow=(None,)))
    batch_size: int = key(16, Rule(int, 1))
    out: str | None = key(None)


def check(cfg: DictConfig, hardware: bool = True) -> None:
    check_keys(cfg, Evaluate)
    if cfg.ckpt_path is None and cfg.model_dir is None:
        raise ConfigError(
            "ckpt_path is required but not set: add ckpt_path=... (or model_dir=<exported folder> with tasks=[...])"
        )
    if cfg.ckpt_path is not None and cfg.model_dir is not None:
        raise ConfigError("give one of ckpt_path=<checkpoint> or model_dir=<Hugging Face folder>, not both")
    if cfg.model_dir is not None and not cfg.tasks:
        raise ConfigError("model_dir= is for tasks=[...]; the loss of an exported folder needs its ckpt_path")


def _task(cfg: DictConfig) -> dict:
    return evaluate(cfg, list(HydraConfig.get().overrides.task))


def main(argv: list[str] | None = None) -> None:
    """The console script; `argv` (instead of sys.argv) lets tests run it in-process."""
    app.run("eval", _task, argv, check=check, rewrite=source_alias, list_keys=True)


if __name__ == "__main__":
    main()
