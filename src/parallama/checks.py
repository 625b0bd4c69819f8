"""Cross-key checks of the composed config, run before any data is read or any process is started.

Each failure is a `ConfigError` whose one-line message names the key and what would be valid.
(Single-key checks live where the value is used: LlamaConfig, TextDataModule, the strategies.)
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from parallama.errors import ConfigError

_SKIP_PREFLIGHT = ("-", "hydra.", "hydra/", "+hydra", "~hydra")


def auto_precision() -> str:
    """`trainer.precision: ${auto_precision:}`: bf16 mixed precision where the GPU supports it, else fp32."""
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return "bf16-mixed" if cuda_bf16 else "32-true"


OmegaConf.register_new_resolver("auto_precision", auto_precision, replace=True)


def preflight(conf_dir: Path, config_name: str, argv: list[str]) -> None:
    """Compose the config as Hydra will and check it, so a typo costs one line and starts no process.

    Skipped for Hydra's own flags (-m, --cfg, ...) where Hydra reports for itself.
    """
    if any(arg.startswith(_SKIP_PREFLIGHT[:1]) for arg in argv):
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = [arg for arg in argv if not arg.startswith(_SKIP_PREFLIGHT[1:])]
    with initialize_config_dir(str(conf_dir), version_base="1.3"):
        try:
            if any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(overrides)):
                return  # a sweep (hydra.mode=MULTIRUN a=1,2): each job is checked when it starts
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
        except (HydraException, OmegaConfBaseException) as err:
            message = f"{err}\n{err.__cause__ or ''}"
            raise ConfigError(_one_line(message, lambda: compose(config_name))) from None
    HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} interpolations resolve
    with open_dict(cfg):
        del cfg["hydra"]
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is required but not set: add {missing[0]}=...")
    check_config(cfg)


def _one_line(message: str, compose_defaults: Callable[[], DictConfig]) -> str:
    """Hydra's error in one line. `compose_defaults` gives the config without overrides, for "did you mean";
    it is called only for an unknown key, an override error, so the config files themselves compose."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if (match := re.match(r"Could not override '([^']+)'", lines[0])) and "not in struct" in message:
        key = match.group(1)
        suggestion = _did_you_mean(key, compose_defaults())
        return f"unknown config key '{key}'{suggestion}; to add a new key write +{key}=..."
    if match := re.search(r"Could not find '([^']+)'", lines[0]):
        group, _, option = match.group(1).rpartition("/")
        start = next((i for i, line in enumerate(lines) if line.startswith("Available options")), None)
        options = []
        if start is not None:
            options = [
                line
                for line in lines[start + 1 :]
                if not line.startswith(("Config search path", "provider="))
            ]
        return f"{group}={option} is not an option of config group '{group}'; valid: {', '.join(options)}"
    return " ".join(lines[:3])


def _did_you_mean(key: str, defaults: DictConfig) -> str:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(defaults, parent) if parent else defaults
    if not isinstance(node, DictConfig):
        return ""
    close = difflib.get_close_matches(leaf, [str(k) for k in node.keys()], n=1)
    return f" (did you mean '{parent + '.' if parent else ''}{close[0]}'?)" if close else ""


def check_config(cfg: DictConfig) -> None:
    _check_types(cfg)
    _check_optimizer(cfg)
    model, data, trainer = cfg.model, cfg.data, cfg.trainer
    _check_model_shape(model)
    if data.seq_len > model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds model.max_position_embeddings={model.max_position_embeddings}"
        )
    _check_devices(trainer)
    _check_strategy(cfg)
    _resolve_global_batch(cfg)


_NUMBERS = {
    "data.seq_len": int,
    "data.batch_size": int,
    "trainer.max_steps": int,
    "trainer.num_nodes": int,
    "scheduler.warmup_steps": int,
    "optimizer.lr": float,
    "optimizer.weight_decay": float,
}


def _check_types(cfg: DictConfig) -> None:
    for key, kind in _NUMBERS.items():
        value = OmegaConf.select(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise ConfigError(f"{key}={value!r} must be {'a number' if kind is float else 'an integer'}")
        if key in ("data.seq_len", "data.batch_size", "trainer.num_nodes") and value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")


def _check_model_shape(model: DictConfig) -> None:
    from parallama.model import LlamaConfig

    fields = OmegaConf.to_container(model, resolve=True)
    if fields.get("vocab_size") is None:
        fields["vocab_size"] = 1  # filled in from the tokenizer later
    try:
        LlamaConfig(**fields)
    except TypeError as err:  # an unknown field
        raise ConfigError(f"model: {err}; valid fields are LlamaConfig's (Hugging Face names)") from None
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_optimizer(cfg: DictConfig) -> None:
    lr = cfg.optimizer.lr
    if not 0 < lr <= 1:
        raise ConfigError(f"optimizer.lr={lr} is out of range; use a value in (0, 1], e.g. 3e-4")
    sched = cfg.scheduler
    if sched.warmup_steps < 0:
        raise ConfigError(f"scheduler.warmup_steps={sched.warmup_steps} must be >= 0")
    if not 0 <= sched.min_lr_ratio <= 1 or not 0 <= sched.warmup_start_factor <= 1:
        raise ConfigError("scheduler.min_lr_ratio and scheduler.warmup_start_factor must be in [0, 1]")
    max_steps = cfg.trainer.get("max_steps", -1)
    if max_steps is not None and max_steps > 0 and sched.warmup_steps >= max_steps:
        raise ConfigError(
            f"scheduler.warmup_steps={sched.warmup_steps} is not below trainer.max_steps={max_steps}; "
            "lower the warmup or train longer"
        )


def _check_devices(trainer: DictConfig) -> None:
    accelerator, devices = trainer.accelerator, trainer.devices
    gpus = torch.cuda.device_count()
    if accelerator in ("gpu", "cuda") and gpus == 0:
        raise ConfigError(
            f"trainer.accelerator={accelerator} but no GPU is visible; use trainer.accelerator=cpu or auto"
        )
    if isinstance(devices, int) and devices < 1:
        raise ConfigError(f"trainer.devices={devices} must be >= 1 (or auto)")
    uses_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpus > 0)
    if uses_gpu and isinstance(devices, int) and devices > gpus:
        raise ConfigError(f"trainer.devices={devices} but only {gpus} GPU(s) are visible on this node")


def _check_strategy(cfg: DictConfig) -> None:
    uses_gpu = cfg.trainer.accelerator in ("gpu", "cuda") or (
        cfg.trainer.accelerator == "auto" and torch.cuda.is_available()
    )
    backend = cfg.strategy.get("process_group_backend")
    if backend == "nccl" and not uses_gpu:
        raise ConfigError(
            "strategy.process_group_backend=nccl needs GPUs; on CPU use gloo (or null to choose)"
        )
    if cfg.strategy.get("mixed_precision") == "fp16" and not uses_gpu:
        raise ConfigError("strategy.mixed_precision=fp16 needs GPUs; on CPU use bf16 or null")
    if not uses_gpu and isinstance(cfg.trainer.devices, int) and cfg.trainer.devices > (os.cpu_count() or 1):
        raise ConfigError(
            f"trainer.devices={cfg.trainer.devices} CPU processes but this machine has {os.cpu_count()} cores"
        )


def _resolve_global_batch(cfg: DictConfig) -> None:
    """`global_batch_size`, when set, fixes trainer.accumulate_grad_batches for the given world size."""
    global_batch = cfg.get("global_batch_size")
    if global_batch is None:
        return
    devices = (
        cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else max(1, torch.cuda.device_count())
    )
    per_step = cfg.data.batch_size * devices * cfg.trainer.num_nodes
    if global_batch % per_step:
        raise ConfigError(
            f"global_batch_size={global_batch} is not a multiple of data.batch_size * devices * nodes "
            f"= {cfg.data.batch_size} * {devices} * {cfg.trainer.num_nodes} = {per_step}"
        )
    with open_dict(cfg):
        cfg.trainer.accumulate_grad_batches = global_batch // per_step
