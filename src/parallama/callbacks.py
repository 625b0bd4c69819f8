"""Callbacks that need to know parallama's batch layout. Everything else in conf/callbacks is Lightning's own."""

from __future__ import annotations

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
    """`last.ckpt` every N optimizer steps and/or every T, and always at the end of training.

    Lightning's own end-of-training save is skipped once any `last` was written during the run, which would
    leave the final steps out of last.ckpt.
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
            train_time_interval=train_time_interval,
        )

    def on_train_end(self, trainer, pl_module) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # skips fast_dev_run and an already-saved step
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
