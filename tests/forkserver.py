"""Start the CLIs' processes from a process that has already imported torch and Lightning.

On the 2-core CI machine `import torch, lightning` takes ~8 s of a tiny run's ~9.5 s (lightning imports
torchmetrics, which imports transformers, scipy.signal and matplotlib; torch._dynamo), and the suite starts a few
hundred of them. The server imports parallama's training path too (the ddp case of
tests/distributed/test_strategies.py runs as a user's shell starts it, so nothing imported here can hide a missing
import). Each `run_cli` is still its own process, with its own argv, environment, working directory, exit status
and stdout/stderr, run as `python -m <module>` runs it: this server forks it after the imports instead of a fresh
interpreter doing them again.

The processes such a run starts are forked too, and stay its children: tests/zygote.py.

The server takes one request per line on stdin (JSON: module, args, cwd, env, out, err), forks the run, answers
`{"pid": ...}` and, once the run has ended, `{"status": ...}`. `PARALLAMA_TEST_FORK=0` runs plain subprocesses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from zygote import SITE_PATH, become


def serve() -> None:
    """The server: import what every CLI imports, then fork one run per request."""
    own = 1 + len([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    SITE_PATH[:] = sys.path[own:]
    import hydra  # noqa: F401
    import lightning  # noqa: F401  (the ~8 s)
    import torch  # noqa: F401

    # what a training run's every process imports after that (~0.3 s of CPU each, a few hundred processes); not
    # parallama.cli.*, the modules runs start with `-m` (runpy warns when one is imported already)
    import parallama.app.run  # noqa: F401
    import parallama.parallel.strategies.ddp  # noqa: F401
    import parallama.parallel.strategies.fsdp  # noqa: F401
    import parallama.parallel.strategies.model_parallel  # noqa: F401
    import parallama.training.module  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run(request)  # never returns
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


def run(request: dict) -> None:
    """In the forked child: become `python -m <module> <args>` in the request's cwd and environment."""
    try:
        os.setpgrp()  # a timeout kills the run with the ranks it started
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fds = {
            0: os.open(os.devnull, os.O_RDONLY),
            1: os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
            2: os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644),
        }
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    become(["-m", request["module"], *request["args"]], request["env"], request["cwd"], fds)


class ForkServer:
    """The client, one per test process (pytest-xdist worker)."""

    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,  # unbuffered: select() on the pipe then sees every line not yet read
        )
        self.outputs = Path(
            tempfile.mkdtemp(prefix="forkserver-")
        )  # a run's stdout and stderr, read after it

    def run(
        self, module: str, args: list[str], cwd: Path, env: dict, timeout: float
    ) -> subprocess.CompletedProcess:
        out, err = self.outputs / "stdout", self.outputs / "stderr"
        request = {
            "module": module,
            "args": args,
            "cwd": str(cwd),
            "env": env,
            "out": str(out),
            "err": str(err),
        }
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        pid = json.loads(self.proc.stdout.readline())["pid"]
        status = self._status(pid, timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        if status is None:
            raise subprocess.TimeoutExpired([module, *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess([module, *args], status, stdout, stderr)

    def _status(self, pid: int, timeout: float) -> int | None:
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            timed_out = not selector.select(timeout)
        if timed_out:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status = json.loads(self.proc.stdout.readline())["status"]
        return None if timed_out else status

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.outputs, ignore_errors=True)


if __name__ == "__main__":
    serve()
