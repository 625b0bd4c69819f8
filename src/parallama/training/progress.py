"""Progress that reads well where it lands: a live bar on a terminal, plain lines in a log file.

A progress bar redraws one line in place, so in a file (`> train.log`, a SLURM job's output) it shows nothing
until the end. When stdout is not a terminal a line is logged every few optimizer steps instead.
"""

from __future__ import annotations

import logging
import sys
import time

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

from parallama.training import syncs

log = logging.getLogger("parallama")


def progress_bar(refresh_rate: int = 10, line_every_n_steps: int = 50) -> ProgressBar:
    """`LiveBar(refresh_rate)` on a terminal, else `LineProgress(line_every_n_steps)`."""
    if sys.stdout.isatty():
        return LiveBar(refresh_rate=refresh_rate)
    return LineProgress(line_every_n_steps)


def train_loss(trainer) -> float | None:
    """The last logged train/loss. The module logs it without `prog_bar`: Lightning reads every progress-bar
    metric from the device after every batch, which on a GPU waits for the step (training/syncs.py)."""
    loss = trainer.callback_metrics.get("train/loss")
    return None if loss is None else float(loss)


class LiveBar(RichProgressBar):
    """Lightning's RichProgressBar with train/loss, read every `refresh_rate` optimizer steps on a CPU and on the
    logging steps on a GPU (training/syncs.py), not after every batch. Test: tests/integration/test_host_syncs.py."""

    def __init__(self, refresh_rate: int = 10) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self._loss: float | None = None

    def get_metrics(self, trainer, pl_module) -> dict:
        step = trainer.global_step
        due = (
            syncs.logging_step(trainer, step)
            if syncs.device_waits(trainer)
            else step % self.refresh_rate == 0
        )
        if due and trainer.training:
            self._loss = train_loss(trainer)
        loss = {} if self._loss is None else {"train/loss": self._loss}
        return {**super().get_metrics(trainer, pl_module), **loss}


class LineProgress(ProgressBar):
    """`step 150/500 (30%)  train/loss 1.9321  3.1 steps/s  eta 1m53s`, every N optimizer steps, and each
    validation's result. Lightning disables progress bars on every rank but 0; its TQDMProgressBar writes a log
    file a redraw per batch. Test: tests/integration/test_cli.py::test_log_file_progress_and_the_config_in_the_run_dir."""

    def __init__(self, every_n_steps: int = 50) -> None:
        super().__init__()
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._started: tuple[float, int] | None = None
        self._last_logged = -1

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._started = (time.monotonic(), trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if not self._enabled or step == self._last_logged or step % self.every_n_steps:
            return
        self._last_logged = step
        start_time, start_step = self._started
        rate = (step - start_step) / max(time.monotonic() - start_time, 1e-9)
        total = trainer.max_steps if trainer.max_steps > 0 else None
        parts = [f"step {step}" + (f"/{total} ({100 * step / total:.0f}%)" if total else "")]
        loss = train_loss(trainer)
        if loss is not None:
            parts.append(f"train/loss {loss:.4f}")
        parts.append(f"{rate:.2f} steps/s")
        if total and rate > 0:
            parts.append(f"eta {_duration((total - step) / rate)}")
        log.info("  ".join(parts))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._enabled or trainer.sanity_checking:
            return
        metrics = {k: f"{float(v):.4f}" for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics:
            log.info(f"step {trainer.global_step}  " + "  ".join(f"{k} {v}" for k, v in metrics.items()))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
