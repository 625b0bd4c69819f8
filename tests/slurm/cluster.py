"""A one-node SLURM cluster on this machine for the tests: munged, slurmctld and slurmd from Debian's packages
(`make slurm` installs them), configured under one folder with this machine's hostname, cores and memory, on free
ports, with a munge socket and key of their own, so nothing under /etc is used or changed.

pytest-xdist workers share one cluster: the first to need it starts it (under a file lock), each records itself
as a user, and the last to finish stops the daemons by their pid files.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel", "sacct")


def unavailable() -> str | None:
    """Why this machine cannot run the cluster (one line), or None."""
    missing = [name for name in (*DAEMONS, *CLIENTS[:5]) if not _which(name)]
    if missing:
        return f"SLURM not installed (no {', '.join(missing)}): `make slurm` installs slurm-wlm and munge as root"
    if (os.cpu_count() or 1) < 2:
        return "the SLURM tests run 2 tasks on one node: this machine has 1 CPU"
    if os.geteuid() != 0:
        return "slurmd runs jobs as any user only as root: run the SLURM tests as root"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return (
                int(line.split()[1]) // 1024 * 9 // 10
            )  # slurmd refuses a node that claims more than it has
    raise RuntimeError("no MemTotal in /proc/meminfo")


def slurm_conf(root: Path, host: str) -> str:
    """The cluster's slurm.conf: one node (this one, its cores and memory), one default partition, state, logs
    and pids under `root`, munge through root's socket; a job may be requeued and keeps its id."""
    return f"""\
ClusterName=parallama-tests
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobRequeue=1
KillWait=30
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={_mem_mb()} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """The cluster under `root` (root/slurm.conf); `env` is what a client (sbatch, srun, scontrol) needs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}

    def running(self) -> bool:
        return self.conf.exists() and all(self._alive(name) for name in DAEMONS)

    def _alive(self, name: str) -> bool:
        pid = self._pid(name)
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def _pid(self, name: str) -> int | None:
        try:
            return int((self.root / f"{name}.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None

    def start(self, timeout: float = 60) -> None:
        """Write the configuration, start the three daemons, and wait until the node is idle."""
        self.stop()
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(slurm_conf(self.root, socket.gethostname().split(".")[0]))
        env = {**os.environ, **self.env}
        munged = [_which("munged"), "--force", f"--key-file={key}", f"--socket={self.root}/munge.socket"]
        munged += [f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log"]
        munged += [f"--seed-file={self.root}/munged.seed"]
        subprocess.run(munged, check=True, env=env, capture_output=True)
        # -c: a clean start (no jobs or nodes from an earlier state); -i: ignore state files that do not load
        subprocess.run([_which("slurmctld"), "-c", "-i"], check=True, env=env, capture_output=True)
        subprocess.run([_which("slurmd")], check=True, env=env, capture_output=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.client("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        logs = {n: _tail(self.root / f"{n}.log") for n in DAEMONS}
        raise RuntimeError(f"the node is not idle after {timeout:.0f} s (sinfo: {state!r}); logs: {logs}")

    def stop(self) -> None:
        """End the jobs left (a failed test's), then stop the daemons by their pid files: a job's processes
        (slurmstepd and its tasks) outlive slurmd."""
        if self.running():
            jobs = self.client("squeue", "-h", "-o", "%A", check=False).stdout.split()
            if jobs:
                self.client("scancel", "--full", "--signal=KILL", *jobs, check=False)
                for _ in range(300):
                    if not self.client(
                        "squeue", "-h", "-t", "RUNNING,COMPLETING", check=False
                    ).stdout.strip():
                        break
                    time.sleep(0.1)
                self.client("scancel", *jobs, check=False)  # and the pending ones
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self._pid(name)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                if not self._alive(name):
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)

    def client(self, *args: str, check: bool = True, cwd=None, env=None) -> subprocess.CompletedProcess:
        env = {**(os.environ if env is None else env), **self.env}
        proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc


def _tail(path: Path, lines: int = 5) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@contextmanager
def shared_cluster(root: Path, user: str):
    """The cluster under `root`, started by its first user and stopped after its last (`user`: this process)."""
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root)
    users = root / "users"
    with _locked(root / "lock"):
        if not cluster.running():
            cluster.start()
        users.write_text("".join(f"{u}\n" for u in {*_lines(users), user}))
    try:
        yield cluster
    finally:
        with _locked(root / "lock"):
            others = {u for u in _lines(users) if u != user and _pid_alive(int(u))}
            users.write_text("".join(f"{u}\n" for u in others))
            if not others:
                cluster.stop()


def _lines(path: Path) -> set[str]:
    return set(path.read_text().split()) if path.exists() else set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def _locked(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
