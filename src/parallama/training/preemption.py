"""Stopping on a signal: `PreemptionCheckpoint` saves `last.ckpt` on every rank at a step soon after SIGTERM,
SIGUSR1 (SLURM's warning) or SIGINT and stops with `Preempted`; under SLURM it requeues the job. The conf/callbacks
entry `preemption` (docs/strategies.md, *Stopping on a signal*)."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback

from parallama.errors import Preempted
from parallama.runtime.faults import resume_overrides
from parallama.runtime.launch import requeue_slurm_job
from parallama.training import syncs

log = logging.getLogger("parallama")
_stop_signal = 0  # the signal PreemptionCheckpoint recorded in this process (stop_signal)


def stop_signal() -> int:
    """The stop signal this process's run received (0: none). Signals reach a whole process, and with it what
    else it started (SLURM's scancel signals every process of a job): W&B's logger reads it to tell a service
    that died of the same signal from a failure (loggers.PreemptibleWandbLogger)."""
    return _stop_signal


def requeue_single_device_jobs(callbacks: list, plugins: list) -> None:
    """Give the preemption callback the run's SLURM environment, which a single device's strategy does not hold
    (Lightning keeps a cluster environment only on its multi-process strategies): the configured one
    (launcher=slurm's), else, in a SLURM batch job, Lightning's default (SIGUSR1, auto_requeue), so a one-task job
    signalled before its time limit requeues itself as a multi-rank one does."""
    env = next((p for p in plugins if isinstance(p, SLURMEnvironment)), None)
    if env is None and os.environ.get("SLURM_JOB_ID") and SLURMEnvironment.detect():
        env = SLURMEnvironment()
    for callback in callbacks:
        if isinstance(callback, PreemptionCheckpoint):
            callback.slurm_environment = env


class PreemptionCheckpoint(Callback):
    """SIGTERM (a scheduler), SIGUSR1 (SLURM's warning before the time limit) or SIGINT (Ctrl-C): finish the
    optimizer step, save `last.ckpt` on every rank and stop with status 0; `ckpt_path=last` resumes there.

    The handler only records the signal. Every `every_n_steps` optimizer steps the ranks agree on it with one
    all_reduce (MAX) that each reads, so a signal to any one rank stops all of them at the same step, at most
    `every_n_steps` steps later, and every rank takes part in saving (DeepSpeed and FSDP checkpoints are
    collective). `every_n_steps: null`: every step on CPUs; on GPUs on the logging steps
    (`trainer.log_every_n_steps`, 10 by default), which wait for the GPU anyway (training/syncs.py). One process
    needs no agreement and stops at the next step. Then every rank raises `Preempted`, once Lightning has handed
    the step's metrics to the loggers (which it flushes as the run ends): no validation or other end-of-run work,
    since a scheduler's grace period is short. Lightning's own SIGTERM
    handler is replaced once the loop starts (it broadcasts from inside the handler, which deadlocks ranks that
    are in another collective: tests/distributed/test_faults.py::test_fsdp_sigterm_to_rank_0_stops_every_rank); from `setup` until Lightning registers its own, this one is in place. Under
    SLURM with `SLURMEnvironment(auto_requeue=True)` (Lightning's default there) its requeue signal (SIGUSR1, what
    `sbatch --signal=USR1@<s>` sends before the time limit) is taken too: saved the same way, then global rank 0
    requeues the job (`scontrol requeue`), which resumes from last.ckpt; Lightning's own handler would save from
    inside the handler, mid-step and in a collective that may hang. Failures (a NaN loss, a crash) do not save:
    they must not overwrite good weights.
    """

    def __init__(self, dirpath: str, filename: str = "last", every_n_steps: int | None = None) -> None:
        self.path = str(Path(dirpath) / f"{filename}.ckpt")
        self.every_n_steps = every_n_steps
        self.received = 0  # the signal number, once one came
        self._previous: dict[int, object] = {}
        self._sigterm_before_lightning = None
        self._checked_step: int | None = None
        self._requeue: int | None = None  # the SLURM requeue signal, under SLURM with auto_requeue
        self._requeued = False  # the requeue signal came: SLURM's SIGTERM follows (`_restore`)
        self._stopped: Preempted | None = None  # the stop, raised once its step is logged (`_stop`)
        # a single device's strategy holds no cluster environment: app/run.py gives the run's SLURM one here
        self.slurm_environment: SLURMEnvironment | None = None
        global _stop_signal
        _stop_signal = 0  # a new run

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Before Lightning registers its SIGTERM handler: remember what to restore, and record a SIGTERM now."""
        if threading.current_thread() is threading.main_thread():
            self._sigterm_before_lightning = signal.signal(signal.SIGTERM, self._record)

    def on_train_start(self, trainer, pl_module) -> None:
        self._install(trainer)

    def _install(self, trainer) -> None:
        """SIGTERM, SIGUSR1 and SIGINT, after Lightning's registration (its teardown would otherwise restore
        ours); SIGTERM goes back to what it was before Lightning's."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        env = getattr(trainer.strategy, "cluster_environment", None) or self.slurm_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue:
            self._requeue = env.requeue_signal
        signals = [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]
        for signum in signals + ([self._requeue] if self._requeue not in (None, *signals) else []):
            self._previous[signum] = signal.signal(signum, self._record)
        if signal.SIGTERM in self._previous and self._sigterm_before_lightning is not None:
            self._previous[signal.SIGTERM] = self._sigterm_before_lightning

    def _record(self, signum: int, frame) -> None:
        global _stop_signal
        self.received = _stop_signal = self.received or signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self._checked_step:  # accumulating: no optimizer step since the last check
            return
        self._checked_step = trainer.global_step
        signum = self.received
        if trainer.world_size > 1:  # one process needs no agreement (and no wait for the GPU)
            if not self._agree_now(trainer):
                return
            flag = torch.tensor([signum], device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        if signum:
            trainer.save_checkpoint(self.path, weights_only=False)  # a full one: it resumes
            name = signal.Signals(signum).name
            message = f"stopped by {name} at step {trainer.global_step}; last checkpoint: {self.path}"
            if signum == self._requeue:
                self._requeued = True
                trainer.strategy.barrier("requeue")  # every rank has saved
                if not trainer.is_global_zero:
                    stopped = Preempted(f"{message}; rank 0 requeues the job")
                else:
                    # said at once: SLURM ends the job while the ranks wind down (seen: rank 0 killed before its
                    # last line, in tests/slurm/test_srun.py)
                    requeued, words = requeue_slurm_job()  # if not, the line says how to resume it
                    stopped = Preempted(
                        f"{message}; {words}", None if requeued else resume_overrides(self.path), said=True
                    )
                    log.warning(stopped.line)
            else:
                stopped = Preempted(message, resume_overrides(self.path))
            self._stop(trainer, stopped)

    def _stop(self, trainer, stopped: Preempted) -> None:
        """Raised once Lightning has logged this step: it hands the step's metrics (train/loss, ...) to the loggers
        after every `on_train_batch_end`, so raising here lost the stop step's row. `should_stop` has the step
        logged whatever `trainer.log_every_n_steps` says; what comes next is a validation or the next batch, and
        the stop is raised as it starts (`_raise_stop`): no validation or other end-of-run work, as a scheduler's
        grace period is short. The loggers are flushed as Lightning ends a run on an exception."""
        self._stopped = stopped
        trainer.should_stop = True

    def _raise_stop(self) -> None:
        if self._stopped is not None:
            raise self._stopped

    def on_validation_start(self, trainer, pl_module) -> None:
        self._raise_stop()
        self._install(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._raise_stop()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._raise_stop()

    def on_train_end(self, trainer, pl_module) -> None:
        self._raise_stop()

    def _agree_now(self, trainer) -> bool:
        n = self.every_n_steps or (max(trainer.log_every_n_steps, 1) if syncs.device_waits(trainer) else 1)
        return trainer.global_step % n == 0

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        """The handlers from before; but after a requeue SIGTERM stays recorded, not fatal: `scontrol requeue` ends
        the job with it while the ranks wind down (and SIGKILL after its KillWait)."""
        for signum, handler in self._previous.items():
            if not (self._requeued and signum == signal.SIGTERM):
                signal.signal(signum, handler)
        self._previous = {}
