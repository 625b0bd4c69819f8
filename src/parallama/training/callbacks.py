"""Callbacks that need to know parallama's batch layout. Everything else in conf/callbacks is Lightning's own."""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, Checkpoint, ThroughputMonitor
from lightning.pytorch.trainer.states import TrainerFn

from parallama.parallel.base import data_parallel
from parallama.runtime.faults import Preempted
from parallama.training.module import ends_the_run


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor for token batches: logs tokens/s, and FLOP/s + MFU on known GPUs.

    FLOPs per batch come from the model config (6N + attention, see `LlamaConfig.flops_per_token`). Lightning
    counts every rank's batch as its own; ranks that share a batch (tensor, context or pipeline parallel ones)
    each count their share of it (`ParallelDims.batch_share`), so the totals count data-parallel replicas.
    """

    def __init__(self, window_size: int = 50, **kwargs) -> None:
        super().__init__(
            batch_size_fn=self.samples_of, length_fn=self.tokens_of, window_size=window_size, **kwargs
        )
        self.share = 1.0

    def samples_of(self, batch: dict) -> float:
        return batch["input_ids"].size(0) * self.share

    def tokens_of(self, batch: dict) -> float:
        return batch["input_ids"].numel() * self.share

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.share = data_parallel(trainer)[0] / trainer.world_size
        data = trainer.datamodule
        tokens = data.seq_len * data.batch_size
        pl_module.flops_per_batch = pl_module.config.flops_per_token(data.seq_len) * tokens * self.share


class PreemptionCheckpoint(Callback):
    """SIGTERM (a scheduler), SIGUSR1 (SLURM's warning before the time limit) or SIGINT (Ctrl-C): finish the
    optimizer step, save `last.ckpt` on every rank and stop with status 0; `ckpt_path=last` resumes there.

    The handler only records the signal. At each optimizer-step boundary the ranks agree on it with one
    all_reduce (MAX), so a signal to any one rank stops all of them at the same step, and every rank takes
    part in saving (DeepSpeed and FSDP checkpoints are collective). Then every rank raises `Preempted`: no
    validation or other end-of-run work, since a scheduler's grace period is short. Lightning's own SIGTERM
    handler is replaced once the loop starts (it broadcasts from inside the handler, which deadlocks ranks that
    are in another collective); from `setup` until Lightning registers its own, this one is in place. A SLURM
    requeue signal (`SLURMEnvironment(auto_requeue=True)`) stays Lightning's. Failures (a NaN loss, a crash) do
    not save: they must not overwrite good weights.
    """

    def __init__(self, dirpath: str, filename: str = "last") -> None:
        self.path = str(Path(dirpath) / f"{filename}.ckpt")
        self.received = 0  # the signal number, once one came
        self._previous: dict[int, object] = {}
        self._sigterm_before_lightning = None
        self._checked_step: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Before Lightning registers its SIGTERM handler: remember what to restore, and record a SIGTERM now."""
        if threading.current_thread() is threading.main_thread():
            self._sigterm_before_lightning = signal.signal(signal.SIGTERM, self._record)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._install(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        self._install(trainer)

    def _install(self, trainer) -> None:
        """SIGTERM, SIGUSR1 and SIGINT, after Lightning's registration (its teardown would otherwise restore
        ours); SIGTERM goes back to what it was before Lightning's."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        env = getattr(trainer.strategy, "cluster_environment", None)  # none for a single device
        requeue = env.requeue_signal if isinstance(env, SLURMEnvironment) and env.auto_requeue else None
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            if signum != requeue:
                self._previous[signum] = signal.signal(signum, self._record)
        if signal.SIGTERM in self._previous and self._sigterm_before_lightning is not None:
            self._previous[signal.SIGTERM] = self._sigterm_before_lightning

    def _record(self, signum: int, frame) -> None:
        self.received = self.received or signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self._checked_step:  # accumulating: no optimizer step since the last check
            return
        self._checked_step = trainer.global_step
        signum = self.received
        if trainer.world_size > 1:  # one process needs no agreement (and no wait for the GPU)
            flag = torch.tensor([signum], device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        if signum:
            trainer.save_checkpoint(self.path)
            name = signal.Signals(signum).name
            raise Preempted(f"stopped by {name} at step {trainer.global_step}; last checkpoint: {self.path}")

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


class LastCheckpoint(Checkpoint):
    """`last.ckpt` every N optimizer steps and/or every T, and always after the run's last step (the resume point,
    whatever validation does; Lightning's ModelCheckpoint takes N or T, not both).

    The last step is saved from the step itself, like the periodic saves, and not after the loop ends: by then
    Lightning has counted the epoch as finished, so extending the run (a higher max_steps) would skip the rest
    of the epoch. Like ModelCheckpoint it writes nothing under fast_dev_run or outside `fit`, and a step once.
    """

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        filename: str = "last",
    ) -> None:
        self.path = str(Path(dirpath) / f"{filename}.ckpt")
        self.every_n_train_steps = every_n_train_steps
        self.time_interval = train_time_interval
        self.saved_step: int | None = None  # the step of the last save (None: none yet)
        self._started_at_step: int | None = (
            None  # nothing to save before a step (a resume's is saved already)
        )
        self._last_saved_at = time.monotonic()

    def on_train_start(self, trainer, pl_module) -> None:
        self._started_at_step, self._last_saved_at = trainer.global_step, time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self._may_save(trainer):
            return
        n = self.every_n_train_steps
        due = bool(n) and trainer.global_step % n == 0
        if self.time_interval is not None:  # rank 0's clock decides, so that every rank saves
            late = time.monotonic() - self._last_saved_at >= self.time_interval.total_seconds()
            due = trainer.strategy.broadcast(late) or due
        if due or ends_the_run(trainer):
            self._save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._may_save(trainer):  # e.g. stopped early by a callback
            self._save(trainer)

    def _may_save(self, trainer) -> bool:
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        new_step = trainer.global_step not in (self.saved_step, self._started_at_step)
        return fitting and not trainer.fast_dev_run and new_step

    def _save(self, trainer) -> None:
        trainer.save_checkpoint(self.path)
        self.saved_step, self._last_saved_at = trainer.global_step, time.monotonic()


class ValidationTokens(Callback):
    """Counts the labelled tokens a validation saw (parallama-eval prints them beside their mean loss)."""

    def __init__(self) -> None:
        self.count = 0

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self.count += int((batch["labels"] != -100).sum())


class Float8Scales(Callback):
    """float8 under FSDP2's float8 all-gather (parallel/float8.py): after each optimizer step, the weights' scales
    for the next all-gather, computed at once (torchtitan's `precompute_float8_dynamic_scale_for_fsdp`); a no-op
    for a model without such weights. parallama-train adds it when `float8` is set."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from parallama.parallel.float8 import precompute_scales

        precompute_scales(pl_module.model)
