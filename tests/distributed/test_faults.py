"""Signals and failures of multi-rank runs: every rank stops cleanly, or the survivors say which rank died.

Each case runs the CLI in its own process group (so a signal to the group reaches only its ranks), forked as
`run_cli`'s runs are (tests/forkserver.py; `PARALLAMA_TEST_FORK=0`: fresh interpreters). Under Lightning's
launcher rank 0 is the parent of rank 1. The default suite runs a covering subset; the full strategy x signal
matrix is marked `slow` (`pytest -m slow tests/distributed/test_faults.py`).
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import torch
from conftest import LONG, TINY, output_of, start_cli, train, tree_digest, weights
from forkserver import ForkedRun

from parallama.checkpoint.integrity import has_checksums
from parallama.checkpoint.read import load_checkpoint

pytestmark = pytest.mark.multiprocess
STRATEGIES = {"ddp": ["strategy=ddp"], "fsdp": ["strategy=fsdp"], "deepspeed": ["strategy=deepspeed"]}
STOP_WITHIN = 60  # seconds from the signal until every rank has exited
PR_SET_CHILD_SUBREAPER = 36
LONG_RUN = "trainer.max_steps=100000"


def start(tmp_path, cache, run_dir, *args) -> ForkedRun | subprocess.Popen:
    args = [*TINY, *LONG, f"paths.cache_dir={cache}", f"hydra.run.dir={run_dir}", *args]
    proc = start_cli("parallama.cli.train", *args, cwd=tmp_path)
    _started.append(proc)
    return proc


_started: list[ForkedRun | subprocess.Popen] = []


@pytest.fixture(autouse=True)
def stop_leftover_runs():
    """A case that failed midway leaves no run behind (they train for 100000 steps)."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)


@pytest.fixture(autouse=True)
def adopt_orphans():
    """Make this process the subreaper of its descendants: rank 1 (rank 0's child) is reparented here when
    rank 0 ends, so its real exit status can be read."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0)


def rank1(proc: ForkedRun | subprocess.Popen, timeout: float = 120) -> int:
    """The pid of the rank Lightning started: rank 0's child running parallama.cli.train."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for child in psutil.Process(proc.pid).children():
            try:
                if "parallama.cli.train" in child.cmdline():
                    return child.pid
            except psutil.NoSuchProcess:
                pass
        assert proc.poll() is None, output_of(proc)[-3000:]
        time.sleep(0.2)
    raise AssertionError("rank 1 did not start")


def wait_for_last(proc: ForkedRun | subprocess.Popen, run_dir, timeout: float = 240) -> None:
    """Until last.ckpt exists (a file, or a folder swapped in whole): training is under way."""
    last = run_dir / "checkpoints" / "last.ckpt"
    deadline = time.time() + timeout
    while not last.exists():
        assert proc.poll() is None, f"training ended early:\n{output_of(proc)[-3000:]}"
        assert time.time() < deadline, "no last.ckpt in time"
        time.sleep(0.2)


def wait_all(rank0: ForkedRun | subprocess.Popen | None, rank1_pid: int | None, timeout: float = STOP_WITHIN):
    """(rank 0's exit code, rank 1's exit code, seconds until both ended); kills both past `timeout`."""
    t0, codes = time.time(), [None, None]
    while codes[0] is None and rank0 is not None or codes[1] is None and rank1_pid is not None:
        if rank0 is not None and codes[0] is None:
            codes[0] = rank0.poll()
        if rank1_pid is not None and codes[1] is None:
            codes[1] = exit_code(rank1_pid)
        if time.time() - t0 > timeout:
            for pid in (rank0.pid if rank0 else None, rank1_pid):
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"still running {timeout}s after the signal (exit codes so far {codes})")
        time.sleep(0.1)
    return codes[0], codes[1], time.time() - t0


def exit_code(pid: int) -> int | str | None:
    """A descendant's exit code once it has ended, else None; "reaped" if rank 0 collected it unseen.

    Orphaned (rank 0 ended first), it is this process's child and waitpid tells; while rank 0 lives it is a
    zombie of rank 0's and /proc still shows its status (field 52 of /proc/<pid>/stat, waitpid's format).
    """
    try:
        pid_done, status = os.waitpid(pid, os.WNOHANG)
        return os.waitstatus_to_exitcode(status) if pid_done else None
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return "reaped"
    return os.waitstatus_to_exitcode(int(fields[49])) if fields[0] == "Z" else None


def stop_run(tmp_path, cache, strategy: str, target: str, signum: int, *args):
    """A 2-rank run, signalled once last.ckpt exists: `target` is group, rank0 or rank1.

    Returns (rank 0's exit code, rank 1's exit code, seconds to stop, rank 0's output, run dir)."""
    run = tmp_path / f"{strategy}-{target}"
    proc = start(tmp_path, cache, run, *STRATEGIES[strategy], "trainer.devices=2", *args)
    child = rank1(proc)
    wait_for_last(proc, run)
    if target == "group":
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid if target == "rank0" else child, signum)
    code, child_code, seconds = wait_all(proc, child)
    return code, child_code, seconds, output_of(proc), run


def assert_stopped_cleanly(code, out, run, name: str) -> int:
    """Exit 0, the one line, no traceback, a loadable checkpoint whose checksums (every rank's files) check;
    returns its step."""
    assert code == 0, out[-4000:]
    assert f"stopped by {name} at step" in out, out[-3000:]
    assert f"; resume with hydra.run.dir={run} ckpt_path=last" in out, out[-3000:]
    assert "Traceback" not in out, out[-4000:]
    assert has_checksums(run / "checkpoints" / "last.ckpt")  # load_checkpoint verifies them
    return load_checkpoint(run / "checkpoints" / "last.ckpt").meta["global_step"]


def rank1_log(run) -> str:
    return (run / "train_ddp_process_1.log").read_text()


def train_loss_steps(run) -> list[int]:
    with open(run / "csv" / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]]


def test_fresh_run_into_an_old_run_dir_is_refused_and_a_fresh_run_warns_nothing(
    tiny_run, tmp_path, data_cache
):
    """The finished run's own command run again: refused in one line, its directory untouched (found: its
    .hydra/config.yaml and overrides.yaml rewritten, the refusal appended to its train.log)."""
    out = tiny_run.output  # conftest's fresh run
    assert 'ckpt_path="last")` is set' not in out and "was called without a model" not in out
    run = tmp_path / "run"
    shutil.copytree(tiny_run.dir, run)
    before = tree_digest(run)
    again = train(cwd=tmp_path, cache=data_cache, run_dir=run, check=False)
    assert again.returncode == 2
    last = run / "checkpoints" / "last.ckpt"
    expected = f"error: {last} exists: resume it with ckpt_path=last, or pick a new hydra.run.dir"
    lines = (again.stdout + again.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(expected), lines
    assert tree_digest(run) == before


@pytest.mark.parametrize("srun", [False, True], ids=["no-srun", "srun-installed"])
def test_num_nodes_without_a_multi_node_launch_is_refused(tmp_path, data_cache, srun):
    """One line, also where `srun` is installed (a SLURM login node): Lightning's hint that srun is available but
    unused is folded into it (found: a second line). PATH holds srun (a stand-in) or no srun at all."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if srun:
        (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / "srun").chmod(0o755)
    env = {"PATH": str(bin_dir)}
    proc = train("trainer.num_nodes=2", cwd=tmp_path, cache=data_cache, check=False, timeout=60, env=env)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 2 and len(out.splitlines()) == 1, out
    hint = "; srun is installed here but did not start this process" if srun else ""
    assert out.endswith(
        "error: trainer.num_nodes=2 needs a multi-node launch (torchrun --nnodes, SLURM srun, or "
        f"MASTER_ADDR/NODE_RANK set on each node){hint}; see docs/strategies.md"
    )


def test_ctrl_c_saves_and_exits_0(tmp_path, data_cache):
    run = tmp_path / "run"
    proc = start(tmp_path, data_cache, run, LONG_RUN)
    wait_for_last(proc, run)
    proc.send_signal(signal.SIGINT)
    code, _, _ = wait_all(proc, None)
    stopped_at = assert_stopped_cleanly(code, output_of(proc), run, "SIGINT")
    assert train_loss_steps(run) == list(range(1, stopped_at + 1))  # the stop step's row too


def test_ddp_sigterm_to_the_group_stops_every_rank_and_resumes_bitwise(tmp_path, data_cache):
    ddp = ["strategy=ddp", "trainer.devices=2"]
    straight = tmp_path / "straight"
    train(*LONG, *ddp, cwd=tmp_path, cache=data_cache, run_dir=straight)

    code, child_code, _, out, run = stop_run(tmp_path, data_cache, "ddp", "group", signal.SIGTERM)
    stopped_at = assert_stopped_cleanly(code, out, run, "SIGTERM")
    assert child_code == 0 and f"stopped by SIGTERM at step {stopped_at}" in rank1_log(run)
    assert 3 <= stopped_at < 40, out[-3000:]
    assert train_loss_steps(run) == list(range(1, stopped_at + 1))  # found: the stop step's row was lost

    train(*LONG, *ddp, "ckpt_path=last", cwd=tmp_path, cache=data_cache, run_dir=run)
    final, expected = (
        weights(run / "checkpoints" / "last.ckpt"),
        weights(straight / "checkpoints" / "last.ckpt"),
    )
    for name, tensor in expected.items():
        assert torch.equal(final[name], tensor), name  # bitwise: the stop lost and repeated nothing


def test_ranks_agreeing_every_n_steps_stop_together_at_such_a_step(tmp_path, data_cache):
    """As on GPUs, where the ranks agree on a signal on logging steps only (no wait for the GPU in between): a
    signal to one rank stops both at the same step, the next multiple of N."""
    every = "callbacks.preemption.every_n_steps=4"
    code, child_code, _, out, run = stop_run(
        tmp_path, data_cache, "ddp", "rank1", signal.SIGTERM, every, LONG_RUN
    )
    stopped_at = assert_stopped_cleanly(code, out, run, "SIGTERM")
    assert child_code == 0 and f"stopped by SIGTERM at step {stopped_at}" in rank1_log(run)
    assert stopped_at % 4 == 0, out[-3000:]


def test_fsdp_sigterm_to_rank_0_stops_every_rank(tmp_path, data_cache):
    code, child_code, _, out, run = stop_run(tmp_path, data_cache, "fsdp", "rank0", signal.SIGTERM, LONG_RUN)
    assert_stopped_cleanly(code, out, run, "SIGTERM")
    assert child_code == 0 and "stopped by SIGTERM at step" in rank1_log(run)


def test_deepspeed_sigusr1_to_rank_1_stops_every_rank(tmp_path, data_cache):
    code, child_code, _, out, run = stop_run(
        tmp_path, data_cache, "deepspeed", "rank1", signal.SIGUSR1, LONG_RUN
    )
    assert_stopped_cleanly(code, out, run, "SIGUSR1")
    assert child_code == 0 and "stopped by SIGUSR1 at step" in rank1_log(run)


def test_kill_9_of_rank_1_ends_rank_0_with_one_line(tmp_path, data_cache):
    code, _, _, out, run = stop_run(tmp_path, data_cache, "ddp", "rank1", signal.SIGKILL, LONG_RUN)
    assert code == 4 and "Traceback" not in out, out[-4000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "error: rank 1 died (killed by signal 9) at step" in errors[0], out[-3000:]
    last = run / "checkpoints" / "last.ckpt"
    assert f"; last checkpoint: {last}; resume with hydra.run.dir={run} ckpt_path=last" in errors[0]


def test_kill_9_of_rank_0_ends_rank_1_with_one_line(tmp_path, data_cache):
    _, child_code, _, _, run = stop_run(tmp_path, data_cache, "ddp", "rank0", signal.SIGKILL, LONG_RUN)
    log = rank1_log(run)
    assert child_code == 4 and "Traceback" not in log, log[-4000:]
    errors = [line for line in log.splitlines() if "error:" in line]
    assert len(errors) == 1 and "error: rank 0 died at step" in errors[0], log[-3000:]


MATRIX = [
    (strategy, target, signum)
    for strategy in STRATEGIES
    for target, signum in [
        ("group", signal.SIGTERM),
        ("rank0", signal.SIGTERM),
        ("rank1", signal.SIGTERM),
        ("group", signal.SIGUSR1),
    ]
]


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(3))
@pytest.mark.parametrize(("strategy", "target", "signum"), MATRIX, ids=lambda v: getattr(v, "name", v))
def test_matrix_every_rank_stops_with_status_0(tmp_path, data_cache, strategy, target, signum, trial):
    code, child_code, seconds, out, run = stop_run(tmp_path, data_cache, strategy, target, signum, LONG_RUN)
    print(
        f"MATRIX {strategy} {target} {signum.name} trial {trial}: exits {code}/{child_code} in {seconds:.1f}s"
    )
    assert_stopped_cleanly(code, out, run, signum.name)
    assert child_code == 0 and f"stopped by {signum.name} at step" in rank1_log(run)


def test_a_requeued_slurm_job_resumes_its_run_dir(tiny_run, tmp_path, data_cache, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(tiny_run.dir, run)  # the job's first run (conftest's), at step 4
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # set by SLURM in a requeued job
    again = train("trainer.max_steps=6", cwd=tmp_path, cache=data_cache, run_dir=run)
    assert (
        f"Restoring states from the checkpoint path at {run}/checkpoints/last.ckpt"
        in again.stdout + again.stderr
    )
