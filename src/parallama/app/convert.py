"""Any strategy's training checkpoint, written at any world size (a Lightning file, a DeepSpeed folder, a DCP
folder), in another format, offline on CPU, with weights, AdamW moments, LR schedule, counters, data position and
W&B run id (the tool is `parallama-ckpt convert`, cli/ckpt.py).

Training resumes from any of these formats under any strategy anyway (docs/strategies.md, "Changing strategy
or GPU count mid-run"); converting makes a portable copy: one file for a small model, a DCP folder that
reshards for FSDP, or the folder DeepSpeed itself writes at `devices` ranks with ZeRO `stage`, `offload` and
`precision`, which `strategy=deepspeed` then loads natively at that world size. DeepSpeed's partitioning is its
own, so that folder is written by DeepSpeed: `devices` processes (gloo) load the checkpoint and save it.

Every process holds the full fp32 weights and moments (12 bytes per parameter) in host memory while it
converts: a DeepSpeed folder for `devices` ranks needs `devices` times that on the machine that converts.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from parallama.checkpoint import universal
from parallama.checkpoint.formats import INFO_KEY, LIGHTNING_TENSORS, verify_checkpoint
from parallama.errors import ConfigError
from parallama.runtime.launch import needs_launch, start_ranks, use_private_torch_extensions


def convert(cfg) -> None:
    """`cfg`: src, out, format, and for format=deepspeed devices, stage, offload, precision (conf/ckpt.yaml)."""
    rank = int(os.environ.get("LOCAL_RANK", 0))  # format=deepspeed re-runs this on `devices` ranks
    if rank == 0:
        if Path(cfg.out).exists():
            raise ConfigError(f"out={cfg.out} exists; give a new path")
        verify_checkpoint(cfg.src)
    state = universal.read(cfg.src)
    if cfg.format == "deepspeed":
        write_deepspeed(cfg, state)
    else:
        universal.write(state, cfg.out, cfg.format)
    if rank == 0:
        step = state.client.get("global_step", "?")
        print(f"converted {cfg.src} (step {step}) to {cfg.out} ({cfg.format})")


def write_deepspeed(cfg, state: universal.UniversalState) -> None:
    """DeepSpeed writes the folder: `cfg.devices` ranks (this command, re-run) each load the checkpoint through
    parallama's universal path into a ZeRO engine and save it before any step."""
    hparams = state.client.get("hyper_parameters")
    if not hparams or "model" not in hparams:
        raise ConfigError(
            f"src={cfg.src} holds no model hyper-parameters (not a parallama training checkpoint)"
        )
    if state.optimizer is None:
        raise ConfigError(f"src={cfg.src} holds weights only; DeepSpeed's folder needs the optimizer state")

    import lightning as L  # start-up time (lightning)

    from parallama.parallel.strategies.deepspeed import DeepSpeed  # start-up time (lightning)
    from parallama.training.module import CausalLM  # start-up time (lightning)

    use_private_torch_extensions()
    # This stand-in run has none of the source run's callbacks or validation data, and needs none.
    warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint need to be provided")
    warnings.filterwarnings("ignore", message=".*but have no `val_dataloader`")

    class SaveBeforeTheFirstStep(L.Callback):
        """Save as soon as training would start, with the source's Lightning state (loops, callbacks' state, LR
        schedulers, data position, W&B run id) in place of this stand-in run's; then stop."""

        def on_train_start(self, trainer, pl_module) -> None:
            trainer.save_checkpoint(cfg.out)
            trainer.should_stop = True

        def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
            for key, value in state.client.items():
                if key not in (*LIGHTNING_TENSORS, INFO_KEY):
                    checkpoint[key] = value  # the module's hook then records the new writer (INFO_KEY)

    module = CausalLM(**{**hparams, "compile": False, "init_from": None})
    strategy = DeepSpeed(
        stage=cfg.stage,
        offload_optimizer=cfg.offload,
        offload_parameters=cfg.offload and cfg.stage == 3,
        logging_batch_size_per_gpu=1,
    )
    if needs_launch(cfg.devices):
        start_ranks(cfg.devices, num_nodes=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=cfg.devices,
        strategy=strategy,
        precision=cfg.precision,
        max_steps=2**31 - 1,  # only sizes the LR schedule built here; the checkpoint keeps its own
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveBeforeTheFirstStep()],
    )
    batch = {"input_ids": torch.zeros(1, 2, dtype=torch.long), "labels": torch.zeros(1, 2, dtype=torch.long)}
    trainer.fit(module, train_dataloaders=[batch], ckpt_path=str(Path(cfg.src).resolve()))
