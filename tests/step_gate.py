"""A test's hand on a run's steps: the first run to reach optimizer step `step` says so (a file `rank<R>` in
`folder`, one per rank) and waits until parallama's preemption callback has recorded a signal, so that a test
interrupts a job (SIGTERM, scontrol requeue, scancel, SLURM's time-limit signal) at a chosen step instead of after
a sleep: every rank then stops at the next step. A later run with the same folder (a resumed or retried job, the
next trial of a study) passes. Added with the override `gate(step, folder)`; the run's processes need tests/ on
PYTHONPATH."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from parallama.training.preemption import PreemptionCheckpoint


def gate(step: int, folder: str | os.PathLike) -> str:
    """The override that adds the gate to a run."""
    return f"+callbacks.gate={{_target_:step_gate.PauseAt,step:{step},folder:'{folder}'}}"


class PauseAt(Callback):
    def __init__(self, step: int, folder: str, timeout: float = 600) -> None:
        self.step, self.folder, self.timeout = step, Path(folder), timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        mark = self.folder / f"rank{trainer.global_rank}"
        if trainer.global_step != self.step or mark.exists():  # not the step, or an earlier run paused here
            return
        (preemption,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
        self.folder.mkdir(parents=True, exist_ok=True)
        mark.write_text(f"{os.environ.get('SLURM_JOB_ID', '')} {os.getpid()}")
        deadline = time.monotonic() + self.timeout
        while not preemption.received and time.monotonic() < deadline:
            time.sleep(0.1)
