"""What a run does when a rank dies or the launch cannot work; see docs/strategies.md, "Signals and failures".

- `check_multi_node`: `trainer.num_nodes>1` with no multi-node launcher around would wait for peers forever.
- `watch_ranks` / `lost_rank`: a rank killed mid-run ends the others with one line naming it and exit status
  `EXIT_RANK_DIED`, instead of a gloo traceback (or, on NCCL, a hang).

Stopping on SIGTERM/SIGUSR1/SIGINT is `parallama.training.preemption.PreemptionCheckpoint`; it raises `Preempted`.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path

from parallama.errors import EXIT_RANK_DIED, ConfigError
from parallama.runtime.launch import started_ranks

log = logging.getLogger("parallama")

# How gloo (and the TCP store) report a peer whose process is gone.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def last_checkpoint_note(output_dir: str) -> str:
    """What a stopped run says about resuming it: its checkpoint and the overrides that resume it, or that there
    is nothing to resume (never advice that cannot work)."""
    found = run_checkpoints(output_dir)
    if not found:
        return "no checkpoint was written yet: nothing to resume, start afresh without ckpt_path"
    return f"last checkpoint: {found[0]}; resume with {resume_overrides(found[0])}"


def resume_overrides(checkpoint: str | os.PathLike) -> str:
    """The overrides that resume `checkpoint`: in its run directory when it sits in <run>/checkpoints (the run
    continues there, `ckpt_path=last`), else by its path."""
    path = Path(checkpoint)
    if path.parent.name == "checkpoints":
        return f"hydra.run.dir={path.parent.parent} ckpt_path=last"
    return f"ckpt_path={path}"


def run_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """A run's checkpoints in the order `ckpt_path=last` tries them: last.ckpt (the resume point), last.ckpt.old
    (a folder checkpoint is `.old` for an instant while its successor is swapped in), then the others (the best
    by val/loss), newest first."""
    folder = Path(run_dir) / "checkpoints"
    last = [folder / name for name in ("last.ckpt", "last.ckpt.old") if (folder / name).exists()]
    others = [p for p in folder.glob("*.ckpt") if p.name != "last.ckpt"]
    return last + sorted(others, key=lambda p: p.stat().st_mtime, reverse=True)


def check_multi_node(num_nodes: int) -> None:
    """Without a launcher that starts the other nodes, Lightning would wait for their ranks forever."""
    # torch-free module
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    env = os.environ
    manual = "MASTER_ADDR" in env and ("NODE_RANK" in env or "GROUP_RANK" in env)
    detected = any(e.detect() for e in (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment))
    if num_nodes > 1 and not (manual or detected):
        srun = "; srun is installed here but did not start this process" if shutil.which("srun") else ""
        raise ConfigError(
            f"trainer.num_nodes={num_nodes} needs a multi-node launch (torchrun --nnodes, SLURM srun, or "
            f"MASTER_ADDR/NODE_RANK set on each node){srun}; see docs/strategies.md"
        )


class _RankWatch(threading.Thread):
    """Notices a dead rank while the trainer runs, and ends this process if its main thread does not.

    The local rank 0 polls the ranks it started (`launch.started_ranks`, Popen objects); a rank it started
    knows its parent is the node's local rank 0. Normally the main thread ends first, on the peer-loss
    error of its next collective (`lost_rank`); a collective that never fails (NCCL) is ended after `grace`.
    """

    def __init__(self, trainer, output_dir: str, period: float = 1.0, grace: float = 20.0) -> None:
        from lightning.fabric.plugins.environments import LightningEnvironment  # torch-free module

        super().__init__(daemon=True, name="parallama-rank-watch")
        self.trainer, self.output_dir, self.period, self.grace = trainer, output_dir, period, grace
        launched = isinstance(getattr(trainer.strategy, "cluster_environment", None), LightningEnvironment)
        self.parent = os.getppid() if launched and trainer.local_rank > 0 else None
        self.stopped = threading.Event()
        self.reported = threading.Lock()  # whoever takes it prints the one line

    def dead_rank(self) -> str | None:
        trainer = self.trainer
        for i, proc in enumerate(started_ranks()):
            how = _exit_of(proc.pid)
            if how is not None:
                return f"rank {trainer.global_rank + i + 1} died ({how})"
        if self.parent is not None and os.getppid() != self.parent:
            return f"rank {trainer.global_rank - trainer.local_rank} died"
        return None

    def line(self, who: str) -> str:
        return f"error: {who} at step {self.trainer.global_step}; {last_checkpoint_note(self.output_dir)}"

    def run(self) -> None:
        from lightning.pytorch.trainer.states import TrainerStatus  # torch-free module

        while not self.stopped.wait(self.period):
            who = self.dead_rank() if self.trainer.state.status == TrainerStatus.RUNNING else None
            if who is not None:
                time.sleep(self.grace)
                if self.reported.acquire(blocking=False):
                    log.error(self.line(who))
                for proc in started_ranks():
                    proc.kill()
                os._exit(EXIT_RANK_DIED)


def _exit_of(pid: int) -> str | None:
    """How a child that failed ended; peeks without reaping, so its exit status stays for whoever waits."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped
        return None
    if info is None or (info.si_code == os.CLD_EXITED and info.si_status == 0):
        return None
    return (
        f"exit status {info.si_status}"
        if info.si_code == os.CLD_EXITED
        else f"killed by signal {info.si_status}"
    )


_watch: _RankWatch | None = None


def watch_ranks(trainer, output_dir: str) -> None:
    """Watch this run's ranks (Lightning's own observer, which SIGKILLs rank 0 without a word, watches only the
    ranks Lightning starts, and parallama starts them itself)."""
    global _watch
    stop_watching()
    _watch = _RankWatch(trainer, output_dir)
    _watch.start()


def stop_watching() -> None:
    """The job is over (a sweep's next job has its own watch); a watch that saw a death keeps its deadline.
    The watch is let go, and with it the finished Trainer (and its process group's store)."""
    global _watch
    if _watch is not None:
        _watch.stopped.set()
        _watch = None


def lost_rank(err: BaseException) -> str | None:
    """The one error line if `err` says a peer rank is gone (naming it when this process can), else None."""
    if not isinstance(err, RuntimeError) or not any(s in str(err) for s in _PEER_LOST) or _watch is None:
        return None
    who = None
    for _ in range(50):  # the dead process may need a moment to become a reapable zombie / orphan this one
        if (who := _watch.dead_rank()) is not None:
            break
        time.sleep(0.1)
    _watch.reported.acquire(blocking=False)
    return _watch.line(who or "another rank's connection closed (it died or was killed)")
