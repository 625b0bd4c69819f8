"""`python -m <module> <args>` runs forked from a process that has imported torch, Lightning and Hydra once
(multiprocessing's forkserver, those modules preloaded), instead of a fresh interpreter importing them again for
every arm run of `train-gpu`: on this 2-core CPU that was 6.8 s of a tiny arm run's 9 s (Lightning imports
torchmetrics, which imports transformers, scipy.signal and matplotlib where they are installed), and a device call
runs some twenty of them.

Each run is still its own process: its own argv, environment, working directory, process group, stdout and
stderr, and its own CUDA context (the server imports and never touches the GPU; torch asks NVML, not the CUDA
driver, whether there is one: `PYTORCH_NVML_BASED_CUDA_CHECK`, as CUDA cannot be used after a fork of a process
that initialized it). What it cannot be is a fresh interpreter: until a forked run has succeeded in a call,
bench/train_gpu.py's `Forks` runs a failed one again afresh, and stops forking if that one succeeds.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

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
