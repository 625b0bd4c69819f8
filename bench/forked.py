"""How `train-gpu`'s arms run, each in its own process (the GPU's memory its own): `python -m <module> <args>`
forked from a process that has imported torch, Lightning and Hydra once (multiprocessing's forkserver, those
modules preloaded), or afresh (`start`). Forked, a run does not import them again: on this 2-core CPU that was
6.8 s of a tiny arm run's 9 s (Lightning imports torchmetrics, which imports transformers, scipy.signal and
matplotlib where they are installed), and a device call runs some twenty of them.

Each run is still its own process: its own argv, environment, working directory, process group, stdout and
stderr, and its own CUDA context (the server imports and never touches the GPU; torch asks NVML, not the CUDA
driver, whether there is one: `PYTORCH_NVML_BASED_CUDA_CHECK`, as CUDA cannot be used after a fork of a process
that initialized it). What it cannot be is a fresh interpreter: until a forked run has succeeded in a call,
`Forks` runs a failed one again afresh, and stops forking if that one succeeds.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT

PRELOAD = ["torch", "lightning", "hydra"]


def run(line: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run(line, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` for a line
    `<python> -m <module> <args>`, forked from the server (started, and its modules imported, on first use)."""
    if line[1] != "-m":
        raise ValueError(f"not a `python -m <module>` line: {line[:3]}")
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the server inherits it when it starts
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = context.Process(target=as_main, args=(line[2], line[3:], str(cwd), env, str(out), str(err)))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:  # the run, and what it started (the compile workers): its process group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                proc.kill()
            proc.join()
        stdout, stderr = (p.read_text(errors="replace") if p.exists() else "" for p in (out, err))
    if timed_out:
        raise subprocess.TimeoutExpired(line, timeout, stdout, stderr)
    return subprocess.CompletedProcess(line, proc.exitcode, stdout, stderr)


def as_main(module: str, args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """In the forked process: be `python -m <module> <args>` in `cwd` and `env`, writing to `out` and `err`."""
    os.setpgrp()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:0] = [cwd, *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]  # as python -m does
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def child_env() -> dict:
    """The arms' processes import `bench` and `parallama` from this checkout (not installed on the GPU machines)."""
    path = [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def last_lines(proc) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return " | ".join(lines[-4:])


def start(line: list[str], timeout: float, fork: bool) -> subprocess.CompletedProcess | None:
    """Run `python -m ...` in its own process (the GPU's memory is its own), forked (`run`) or afresh;
    None where it ran out of time."""
    try:
        if fork:
            return run(line, ROOT, child_env(), timeout)
        return subprocess.run(
            line, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None
    except Exception as err:  # noqa: BLE001  (the forked start failed: `Forks` runs the arm again afresh)
        if not fork:
            raise
        return subprocess.CompletedProcess(line, 1, "", f"forked start failed: {type(err).__name__}: {err}")


def child(command: list[str], timeout: float, fork: bool) -> dict:
    """A `python -m ...` arm that prints its result: its `RESULT {json}` line."""
    proc = start([sys.executable, "-m", *command], timeout, fork)
    if proc is None:
        return {"error": f"timed out after {timeout:.0f} s"}
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        return {"error": last_lines(proc)}
    return json.loads(found[-1][len("RESULT ") :])


class Forks:
    """Whether the arms' runs are forked (`run`). Until a forked run has succeeded, one that fails (not by its
    timeout) runs again afresh; if that succeeds, the call's later runs start afresh too (`note`)."""

    def __init__(self, on: bool) -> None:
        self.on, self.proven, self.note = on, False, None

    def run(self, go) -> dict:
        """`go(fork)`: one run of an arm."""
        result = go(self.on)
        if result.get("rates"):
            self.proven = self.proven or self.on
            return result
        if not self.on or self.proven or "timed out" in result.get("error", ""):
            return result
        again = go(False)
        if again.get("rates"):
            self.on = False
            self.note = (
                f"a forked run failed where a fresh one ran; later runs started afresh: {result['error']}"
            )
        return again
