"""Callbacks that need to know parallama's batch layout. Everything else in conf/callbacks is Lightning's own."""

from __future__ import annotations

import time
from datetime import timedelta

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint, ThroughputMonitor
from lightning.pytorch.utilities.exceptions import SIGTERMException


def _samples(batch: dict) -> int:
    return batch["input_ids"].size(0)


def _tokens(batch: dict) -> int:
    return batch["input_ids"].numel()


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor for token batches: logs tokens/s, and FLOP/s + MFU on known GPUs.

    FLOPs per batch come from the model config (6N + attention, see `LlamaConfig.flops_per_token`).
    """

    def __init__(self, window_size: int = 50, **kwargs) -> None:
        super().__init__(batch_size_fn=_samples, length_fn=_tokens, window_size=window_size, **kwargs)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        data = trainer.datamodule
        pl_module.flops_per_batch = (
            pl_module.config.flops_per_token(data.seq_len) * data.seq_len * data.batch_size
        )


class PreemptionCheckpoint(OnExceptionCheckpoint):
    """Save `last.ckpt` when the job is told to stop (SIGTERM from a scheduler, Ctrl-C), so `ckpt_path=last`
    resumes exactly there. Failures (a NaN loss, a crash) do not save: they must not overwrite good weights."""

    def __init__(self, dirpath: str, filename: str = "last") -> None:
        super().__init__(dirpath=dirpath, filename=filename)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, (SIGTERMException, KeyboardInterrupt)):
            super().on_exception(trainer, pl_module, exception)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        """Keep the file: unlike Lightning's OnExceptionCheckpoint it is last.ckpt, the run's resume point."""


class LastCheckpoint(ModelCheckpoint):
    """`last.ckpt` every N optimizer steps and/or every T, and always after the run's last step.

    The last step is saved from the step itself, like the periodic saves, and not after the loop ends: by then
    Lightning has counted the epoch as finished, so extending the run (a higher max_steps) would skip the rest
    of the epoch. Lightning's ModelCheckpoint takes N or T, not both: T is kept here.
    """

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
    ):
        super().__init__(
            dirpath=dirpath,
            monitor=None,
            save_top_k=0,
            save_last=True,
            enable_version_counter=False,  # always last.ckpt, even if the interval changed since the last run
            every_n_train_steps=every_n_train_steps,
        )
        self.time_interval = train_time_interval
        self._last_saved_at = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._should_skip_saving_checkpoint(trainer):  # fast_dev_run, or this step is saved already
            return
        due = False
        if self.time_interval is not None:  # rank 0's clock decides, so that every rank saves
            due = time.monotonic() - self._last_saved_at >= self.time_interval.total_seconds()
            due = trainer.strategy.broadcast(due)
        loop = trainer.fit_loop.epoch_loop
        last_epoch = (
            0 < (trainer.max_epochs or -1) <= trainer.current_epoch + 1 and loop.batch_progress.is_last_batch
        )
        if due or 0 < trainer.max_steps <= trainer.global_step or last_epoch:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_saved_at = time.monotonic()

    def on_train_end(self, trainer, pl_module) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # e.g. stopped early by a callback
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
