"""Cross-key checks of the composed config, run before any data is read or any process is started.

Each failure is a `ConfigError` whose one-line message names the key and what would be valid.
(Single-key checks live where the value is used: LlamaConfig, TextDataModule, the strategies.)
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig, open_dict

from parallama.errors import ConfigError


def check_config(cfg: DictConfig) -> None:
    _check_optimizer(cfg)
    model, data, trainer = cfg.model, cfg.data, cfg.trainer
    if data.seq_len > model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds model.max_position_embeddings={model.max_position_embeddings}"
        )
    _check_devices(trainer)
    _resolve_global_batch(cfg)


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
        raise ConfigError(f"trainer.accelerator={accelerator} but no GPU is visible; use trainer.accelerator=cpu or auto")
    if isinstance(devices, int) and devices < 1:
        raise ConfigError(f"trainer.devices={devices} must be >= 1 (or auto)")
    uses_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and gpus > 0)
    if uses_gpu and isinstance(devices, int) and devices > gpus:
        raise ConfigError(f"trainer.devices={devices} but only {gpus} GPU(s) are visible on this node")


def _resolve_global_batch(cfg: DictConfig) -> None:
    """`global_batch_size`, when set, fixes trainer.accumulate_grad_batches for the given world size."""
    global_batch = cfg.get("global_batch_size")
    if global_batch is None:
        return
    devices = cfg.trainer.devices if isinstance(cfg.trainer.devices, int) else max(1, torch.cuda.device_count())
    per_step = cfg.data.batch_size * devices * cfg.trainer.num_nodes
    if global_batch % per_step:
        raise ConfigError(
            f"global_batch_size={global_batch} is not a multiple of data.batch_size * devices * nodes "
            f"= {cfg.data.batch_size} * {devices} * {cfg.trainer.num_nodes} = {per_step}"
        )
    with open_dict(cfg):
        cfg.trainer.accumulate_grad_batches = global_batch // per_step
