"""Submitting runs to the tests' SLURM cluster and watching them with the scheduler's own commands."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from pathlib import Path

from conftest import LAUNCH_ENV
from slurm.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


def documented_script() -> str:
    """The sbatch script of docs/strategies.md's SLURM section, as a user copies it."""
    docs = (REPO / "docs" / "strategies.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", docs, flags=re.S)
    (script,) = [textwrap.dedent(b) for b in blocks if "#SBATCH --ntasks-per-node" in b]
    return script


def job_env(gate_dir: Path | None = None) -> dict:
    """What a job inherits (sbatch exports the submitter's environment): this venv's parallama-train first on
    PATH, tests/ importable (step_gate), one thread per rank, no launcher variables of this process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_ENV)}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")]).rstrip(":")
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def sbatch(cluster: Cluster, cwd: Path, *args: str, options: tuple[str, ...] = ()) -> str:
    """Submit the documented script with `args` for parallama-train; the job id."""
    script = cwd / "train.sbatch"
    script.write_text(documented_script())
    proc = cluster.client("sbatch", "--parsable", *options, str(script), *args, cwd=cwd, env=job_env())
    return proc.stdout.strip().split(";")[0]


def job(cluster: Cluster, job_id: str) -> dict:
    """`scontrol show job`'s fields (JobState, Restarts, RunTime, ...)."""
    out = cluster.client("scontrol", "show", "job", "-o", job_id).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_until(what: str, ready, timeout: float = 600, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(every)
    return value


def wait_done(cluster: Cluster, job_id: str, timeout: float = 900) -> dict:
    """The job's fields once it has ended (SLURM keeps them MinJobAge=600 s)."""
    return wait_until(
        f"job {job_id} ends", lambda: (j := job(cluster, job_id))["JobState"] in DONE and j, timeout
    )


def gate_reached(folder: Path, ranks: int, timeout: float = 600) -> None:
    wait_until(
        f"{ranks} ranks at the gate in {folder}", lambda: len(list(folder.glob("rank*"))) == ranks, timeout
    )


def start_requeued_now(cluster: Cluster, job_id: str, timeout: float = 120) -> None:
    """SLURM holds a requeued job back for 2 minutes (its BeginTime): once it is pending again, start it now
    (and with a 10-minute limit, past any time-limit signal)."""
    wait_until(
        f"job {job_id} requeued",
        lambda: (j := job(cluster, job_id))["JobState"] == "PENDING" and int(j["Restarts"]) >= 1,
        timeout,
    )
    cluster.client("scontrol", "update", f"JobId={job_id}", "StartTime=now", "TimeLimit=10")


def output(cwd: Path, job_id: str) -> str:
    return (cwd / f"slurm-{job_id}.out").read_text(errors="replace")
