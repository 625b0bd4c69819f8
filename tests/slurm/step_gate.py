"""A test's hand on a run's steps: at optimizer step `step` every rank says so (a file `rank<R>` in `folder`) and
waits until parallama's preemption callback has recorded a signal, so that a test can interrupt a job (scontrol
requeue, scancel, the time-limit signal) at a chosen step instead of after a sleep. Added to a run with
`+callbacks.gate={_target_:step_gate.PauseAt,step:2,folder:<dir>}` (tests/slurm on PYTHONPATH)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from parallama.training.callbacks import PreemptionCheckpoint


class PauseAt(Callback):
    def __init__(self, step: int, folder: str, timeout: float = 600) -> None:
        self.step, self.folder, self.timeout = step, Path(folder), timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step != self.step:  # a resumed run starts past it
            return
        (preemption,) = [c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)]
        self.folder.mkdir(parents=True, exist_ok=True)
        job = f"{os.environ.get('SLURM_JOB_ID', '')} {os.environ.get('SLURM_RESTART_COUNT', '0')}"
        (self.folder / f"rank{trainer.global_rank}").write_text(job)
        deadline = time.monotonic() + self.timeout
        while not preemption.received and time.monotonic() < deadline:
            time.sleep(0.1)
