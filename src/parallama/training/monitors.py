"""Tokens/s, MFU and learning rates for the loggers, numbered "after N optimizer steps" like every other row, and
read from the device only when a GPU would have to wait anyway (training/syncs.py)."""

from __future__ import annotations

import math
import time

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch.callbacks import Callback

from parallama.parallel.base import data_parallel
from parallama.training import syncs

_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


class TokenThroughputMonitor(Callback):
    """`train/device/items_per_sec` (tokens/s per device), `train/device/flops_per_sec` and `train/device/mfu` on
    known GPUs, over the last `window_size` batches; one `validate/...` row per validation. Lightning's
    `Throughput` arithmetic and key names (its ThroughputMonitor synchronizes the GPU on every batch to read the
    clock, and numbers rows by its own count).

    On a CPU the clock is read every optimizer step; on a GPU only on logging steps, after waiting for the queue,
    so the window there is the batches since the previous reads. FLOPs per batch come from the model config (6N +
    attention, see `LlamaConfig.flops_per_token`). Ranks that share a batch (tensor, context or pipeline parallel
    ones) each count their share of it (`ParallelDims.batch_share`), so totals count data-parallel replicas.
    Computed on rank 0, like Lightning's. Kept for tests/integration/test_host_syncs.py (no device read between
    logging steps).
    """

    def __init__(self, window_size: int = 50, separator: str = "/") -> None:
        self.window_size, self.separator = window_size, separator
        self.share = 1.0
        self._stages: dict[str, Throughput] = {}
        self._counts = [0, 0.0, 0.0]  # batches, samples, tokens since training started (this rank's share)
        self._t0 = 0.0
        self._paused_at = 0.0
        self._read_step: int | None = None
        self._read_batches = 0  # the batch count at the last read
        self._val: tuple[float, list] | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.share = data_parallel(trainer)[0] / trainer.world_size
        data = trainer.datamodule
        tokens = data.seq_len * data.batch_size
        pl_module.flops_per_batch = pl_module.config.flops_per_token(data.seq_len) * tokens * self.share
        precision = str(trainer.precision)
        dtype = next((d for p, d in _COMPUTE_DTYPES.items() if precision.startswith(p)), torch.float32)
        flops = get_available_flops(trainer.strategy.root_device, dtype)
        every = 1 if not syncs.device_waits(trainer) else max(trainer.log_every_n_steps, 1)
        window = self.window_size if every == 1 else max(2, math.ceil(self.window_size / every) + 1)
        for name, size in (("train", window), ("validate", 2)):
            self._stages[name] = Throughput(
                flops, trainer.world_size, window_size=size, separator=self.separator
            )

    def on_train_start(self, trainer, pl_module) -> None:
        self._stages["train"].reset()
        self._counts, self._t0, self._read_step = [0, 0.0, 0.0], time.perf_counter(), trainer.global_step
        self._read_batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        self._count(self._counts, batch)
        step = trainer.global_step
        # not while accumulating (no new optimizer step), and on a GPU on logging steps only
        if step == self._read_step or not syncs.reads_now(trainer, step):
            return
        syncs.wait_for_device(trainer)
        batches, samples, tokens = self._counts
        new_batches = batches - self._read_batches  # Throughput takes the FLOPs since its last update
        flops = pl_module.flops_per_batch * new_batches
        self._read_step, self._read_batches = step, batches
        self._stages["train"].update(
            time=time.perf_counter() - self._t0, batches=batches, samples=samples, lengths=tokens, flops=flops
        )
        if syncs.logging_step(trainer, step):
            self._log(trainer, "train")

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        syncs.wait_for_device(trainer)  # the training steps' queued work belongs to training's time
        self._paused_at = time.perf_counter()
        self._val = (self._paused_at, [0, 0.0, 0.0])

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        if self._val is not None:
            self._count(self._val[1], batch)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val is None:
            return
        syncs.wait_for_device(trainer)
        now = time.perf_counter()
        (start, (batches, samples, tokens)), self._val = self._val, None
        val = self._stages["validate"]
        val.reset()
        val.update(time=0.0, batches=0, samples=0, lengths=0, flops=0)
        if batches:
            flops = pl_module.flops_per_batch * batches
            val.update(time=now - start, batches=batches, samples=samples, lengths=tokens, flops=flops)
            self._log(trainer, "validate")
        self._t0 += now - self._paused_at  # validation's time is not training's

    def _count(self, counts: list, batch: dict) -> None:
        counts[0] += 1
        counts[1] += batch["input_ids"].size(0) * self.share
        counts[2] += batch["input_ids"].numel() * self.share

    def _log(self, trainer, stage: str) -> None:
        metrics = {f"{stage}{self.separator}{k}": v for k, v in self._stages[stage].compute().items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


class LearningRates(Callback):
    """The learning rate each parameter group used in optimizer step N, in the row of step N (with that step's
    loss), on logging steps: `lr-<name>/pg<i>` as Lightning's LearningRateMonitor names them (the scheduler's name,
    else `lr-<optimizer class>`; a group's `name` replaces `pg<i>`). Read when the step starts, before the
    scheduler moves on; Python numbers: nothing is read from the device. Lightning's monitor writes the same rate
    one row earlier (its own count of steps). Tests: tests/integration/test_host_syncs.py,
    tests/integration/test_cli.py::test_console_csv_and_checkpoint_names_number_steps_alike."""

    def __init__(self) -> None:
        self._rates: dict[str, float] | None = None
        self._step = -1  # optimizer steps taken when the batch started

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._step = trainer.global_step
        if trainer.loggers and self._rates is None and syncs.logging_step(trainer, trainer.global_step + 1):
            self._rates = self.rates(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._rates is None or trainer.global_step == self._step:  # nothing to log, or still accumulating
            return
        for logger in trainer.loggers:
            logger.log_metrics(self._rates, step=trainer.global_step)
        self._rates = None

    @staticmethod
    def rates(trainer) -> dict[str, float]:
        found = {}
        for config in trainer.lr_scheduler_configs:
            optimizer = config.scheduler.optimizer
            name = config.name or f"lr-{type(optimizer).__name__}"
            groups = optimizer.param_groups
            for i, group in enumerate(groups):
                label = group.get("name", f"pg{i + 1}" if len(groups) > 1 else None)
                found[f"{name}/{label}" if label else name] = float(group["lr"])
        return found
