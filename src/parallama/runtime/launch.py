"""How the ranks of a run are started, and how the jobs of a sweep stay apart.

A multi-process run that no launcher started (torchrun, SLURM, ...) starts its other ranks on this node
itself, as Lightning's launcher would, but each runs exactly this job: the job's own overrides, in the job's own
directory, never in multirun mode (Lightning re-runs `sys.argv`, which where a sweep runs its jobs in its own
process, hydra/launcher=basic, re-runs the whole sweep in every child, and under the Optuna sweeper has every
child run its own study: test_library_gaps.py test_lightning_starts_a_sweep_jobs_ranks_with_the_whole_sweep).
The ranks learn their place from the environment (`LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR/PORT`, `NODE_RANK`),
Lightning's public contract for processes started outside it. parallama's sweep launcher runs each job in a
process of its own (`job_command`, parallama.sweeps.launcher), which hands its result back through
`JobReturnFile`; where jobs share one process (Hydra's `hydra/launcher=basic`), `JobIsolation` (a Hydra
callback, see conf/hydra/default.yaml) closes each job's process group and environment so that the next job
starts its own ranks instead of joining the finished job's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobStatus
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.utils import get_original_cwd

# Set for the ranks a run starts itself: the rank that started them checked their job (app/compose.py `preflight`).
CHECKED_ENV = "PARALLAMA_CONFIG_CHECKED"
_ranks: list[subprocess.Popen] = []  # the ranks this process started for the job under way


def needs_launch(processes_per_node: int) -> bool:
    """Whether this process must start this node's other ranks: more than one, and nobody started them (a
    launcher sets LOCAL_RANK, torchrun TORCHELASTIC_RUN_ID, a scheduler its own variables)."""
    # torch-free module
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    if processes_per_node < 2 or "LOCAL_RANK" in os.environ:
        return False
    environments = (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment, MPIEnvironment)
    return not any(env.detect() for env in environments)


def start_ranks(processes_per_node: int, num_nodes: int) -> None:
    """Start local ranks 1.. of this node, each running this Hydra job, and make this process local rank 0."""

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("NODE_RANK", "0")
    os.environ["WORLD_SIZE"] = str(processes_per_node * num_nodes)
    os.environ["LOCAL_RANK"] = "0"
    if "OMP_NUM_THREADS" not in os.environ:  # the cores shared out, as Lightning and torchrun do
        import torch  # torch-free module

        threads = max(1, (os.cpu_count() or 1) // processes_per_node)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    hc = HydraConfig.get()
    command = [*job_command(hc, hc.overrides.task, hc.runtime.output_dir), "hydra.output_subdir=null"]
    _ranks.clear()
    for local_rank in range(1, processes_per_node):
        env = {**os.environ, "LOCAL_RANK": str(local_rank), CHECKED_ENV: "1"}  # the job was checked here
        env.pop(JOB_RETURN_ENV, None)  # rank 0 answers the launcher
        rank_command = [*command, f"hydra.job.name=train_ddp_process_{local_rank}"]
        _ranks.append(subprocess.Popen(rank_command, env=env, cwd=get_original_cwd()))


def job_command(hydra_cfg, overrides, output_dir: str) -> list[str]:
    """The command that runs this process's Hydra app once more, as one job: `overrides` (a job's task
    overrides), in `output_dir`, never as a sweep. How a run's other ranks start (`start_ranks`) and how a sweep's
    jobs start in processes of their own (parallama.sweeps.launcher)."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)  # `python -m <module>`; else a script or a console script
    command = (
        [sys.executable, "-m", spec.name]
        if spec is not None
        else [sys.executable, os.path.abspath(sys.argv[0])]
    )
    for source in hydra_cfg.runtime.config_sources:
        if source.provider == "command-line":  # a --config-dir the user gave
            command += ["--config-dir", source.path]
    command += ["--config-name", hydra_cfg.job.config_name, *overrides]
    command += [f'hydra.run.dir="{output_dir}"', "hydra.mode=RUN"]  # a search preset may set MULTIRUN
    return command


def started_ranks() -> list[subprocess.Popen]:
    """The ranks this process started for the job under way."""
    return list(_ranks)


# Where a job started by parallama.sweeps.launcher writes its return value (`JobReturnFile`).
JOB_RETURN_ENV = "PARALLAMA_JOB_RETURN"
# The CPU cores a job of a CPU sweep may use (parallama.sweeps.launcher): its processes pin themselves at start.
JOB_CORES_ENV = "PARALLAMA_JOB_CORES"


def pin_to_job_cores() -> None:
    """Keep this process (and the threads and ranks it starts) on the cores its sweep job was given, if any."""
    cores = os.environ.get(JOB_CORES_ENV)
    if cores:
        os.sched_setaffinity(0, {int(core) for core in cores.split(",")})


def pinned_cores() -> str | None:
    """The cores this process runs on, where a sweep job pinned it ("0,1"); None elsewhere."""
    if not os.environ.get(JOB_CORES_ENV):
        return None
    return ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))


class JobReturnFile(Callback):
    """A job that a sweep's launcher started in a process of its own hands its return value (the optimized
    metric) back through the file the launcher named in JOB_RETURN_ENV."""

    def on_job_end(self, config, job_return, **kwargs) -> None:
        path = os.environ.get(JOB_RETURN_ENV)
        if path and job_return.status == JobStatus.COMPLETED:
            Path(path).write_text(json.dumps(job_return.return_value))


# Set in os.environ for the job under way: by `start_ranks`, a launcher, or W&B's offline logger (WANDB_MODE).
JOB_ENV = (
    *("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE"),
    *("OMP_NUM_THREADS", "WANDB_MODE"),
)


class JobIsolation(Callback):
    """Each job of a sweep starts as the first did: no process group open, no rank variables left behind.

    Otherwise the next job joins the finished job's (gone) process group, and with LOCAL_RANK set Lightning
    would not start its ranks at all.
    """

    def on_job_start(self, config, **kwargs) -> None:
        self.environ = {key: os.environ.get(key) for key in JOB_ENV}
        if config.hydra.job.get("num", 0) and "MASTER_PORT" in os.environ and not _launched_externally():
            # A port the user fixed (MASTER_PORT=...) would be every job's: the finished job's store can still
            # listen there (a reference cycle keeps it alive) and hand the next job its ranks' stale addresses.
            # Ranks this process starts need only agree with it, so each later job gets a free port.
            os.environ["MASTER_PORT"] = str(free_port())

    def on_job_end(self, config, job_return, **kwargs) -> None:
        import torch.distributed as dist  # torch-free module

        deepspeed_comm = sys.modules.get("deepspeed.comm")  # DeepSpeed caches the groups it made: close them
        if deepspeed_comm is not None and deepspeed_comm.is_initialized():
            deepspeed_comm.destroy_process_group()
        elif dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for rank in _ranks:  # reap the ranks that ended with the job (the others: when they end)
            rank.poll()
        for key, value in self.environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def requeue_slurm_job() -> tuple[bool, str]:
    """Put this SLURM job back in the queue (`scontrol requeue`): SLURM ends it and runs the same script again,
    under the same job id and with SLURM_RESTART_COUNT raised, which resumes last.ckpt (checkpoint.resume).
    Returns whether it was requeued and what happened, in words for the run's last line; a failure (no scontrol
    in the job's container, a job that was not submitted with --requeue allowed) is said, not raised: the
    checkpoint is saved either way, and the line then says how to resume it."""
    job = os.environ["SLURM_JOB_ID"]
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"could not requeue SLURM job {job} ({err}): resubmit it"
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1:] or [f"status {proc.returncode}"]
        return False, f"could not requeue SLURM job {job} (scontrol: {why[0]}): resubmit it"
    return True, f"requeued SLURM job {job}: it resumes from there"


def slurm_job_requeued() -> bool:
    """Whether SLURM requeued this job since this run of it started (`scontrol requeue`, a preemption that
    requeues): its restart count has moved past this run's SLURM_RESTART_COUNT."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    try:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    restarts = re.search(r"\bRestarts=(\d+)", out.stdout)
    return restarts is not None and int(restarts[1]) > int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def hand_to_sweep(status: int) -> bool:
    """Whether a run that ends with `status` and its one line must raise instead of exiting: a job of Hydra's
    submitit launcher (launcher=slurm) runs inside submitit's process, which hands the sweep a job's error but
    nothing for an exit, so the sweep would wait for its result (for ever where sacct is off). Except a stopped
    job (0) that SLURM requeued: its next run hands the result back."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return False
    return status != 0 or not slurm_job_requeued()


class SweepJobEnded(CompactHydraException):
    """A job of launcher=slurm that stopped (`scancel`) or failed with its one line (`what`, its exit `status`),
    handed to the sweep's process: its sweeper says it with the other jobs (sweeps/jobs.py), and Hydra's own
    sweepers print a CompactHydraException as it is (exit status 1)."""

    @classmethod
    def of(cls, what: str, status: int) -> SweepJobEnded:
        if status == 0:
            ended = cls(
                f"error: a job of the sweep was {what}; run the same command with ckpt_path=last to resume its jobs"
            )
        else:
            ended = cls(f"error: a job of the sweep failed: {what}")
        ended.what, ended.status = what, status
        return ended


def _launched_externally() -> bool:
    """torchrun, SLURM or another launcher started this process: its port is shared with other nodes."""
    return any(key in os.environ for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "NODE_RANK"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_private_torch_extensions() -> None:
    """DeepSpeed JIT-builds C++ ops into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions, shared by
    every environment). Two environments then rebuild each other's ops, and a build killed midway leaves a lock
    on which every later run waits forever. So: one directory per Python environment, and a lock older than any
    build is removed (with a warning) instead of waited on (`remove_stale_build_locks`). Ranks started later inherit the variable."""

    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        env = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
        tag = f"py{sys.version_info.major}{sys.version_info.minor}-{env}"
        os.environ["TORCH_EXTENSIONS_DIR"] = str(
            Path.home() / ".cache" / "parallama" / "torch_extensions" / tag
        )
    remove_stale_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"]))


# A live build's lock is younger, or a process (ninja, the compiler) works in its folder.
STALE_LOCK_SECONDS = 30


def remove_stale_build_locks(root: Path) -> list[Path]:
    """torch's JIT build of an op holds `<root>/<op>/lock` while it builds and every other process waits for it to
    go, for ever: a build killed mid-way (kill -9) leaves it, and every later DeepSpeed run hung silently at
    "initializing deepspeed distributed". A lock older than STALE_LOCK_SECONDS whose folder no process works in
    (none has its cwd there: torch runs ninja in it) has no owner: removed, said in one line."""

    removed = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:  # TORCH_EXTENSIONS_DIR, or torch's py3x_cpu/
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        if age < STALE_LOCK_SECONDS or _worked_in(lock.parent):
            continue
        lock.unlink(missing_ok=True)
        removed.append(lock)
        logging.getLogger("parallama").warning(
            f"removed {lock}: a build of {lock.parent.name} left it {age:.0f} s ago and no process builds there "
            "now (a killed build); torch would wait for it for ever"
        )
    return removed


def _worked_in(folder: Path) -> bool:
    """Whether a process has its working directory in `folder` (Linux: /proc/<pid>/cwd)."""
    target = str(folder.resolve())
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if os.readlink(cwd).startswith(target):
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


def first_process() -> bool:
    """Global rank 0 of the job before any process group exists: no launcher's rank, or rank 0 of it."""
    ranks = (os.environ.get(k, "0") for k in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))
    return all(r == "0" for r in ranks)
