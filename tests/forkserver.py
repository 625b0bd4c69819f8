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
`{"pid": ...}` and, once the run has ended, `{"status": ...}`; the client waits for the status (`run`) or goes on
while the run does (`start`: the tests that signal a run). `PARALLAMA_TEST_FORK=0` runs plain subprocesses.
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
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        out = os.open(request["out"], flags, 0o644)
        err = out if request["err"] == request["out"] else os.open(request["err"], flags, 0o644)
        fds = {0: os.open(os.devnull, os.O_RDONLY), 1: out, 2: err}
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
        self.running: ForkedRun | None = None
        self.started = 0

    def run(
        self, module: str, args: list[str], cwd: Path, env: dict, timeout: float
    ) -> subprocess.CompletedProcess:
        run = self.start(module, args, cwd, env, merge_stderr=False)
        try:
            status = run.wait(timeout)
        except subprocess.TimeoutExpired:
            run.kill()
            status = None
        stdout, stderr = run.outputs()
        run.out.unlink()
        run.err.unlink()
        if status is None:
            raise subprocess.TimeoutExpired([module, *args], timeout, stdout, stderr)
        return subprocess.CompletedProcess([module, *args], status, stdout, stderr)

    def start(self, module: str, args: list[str], cwd: Path, env: dict, merge_stderr: bool) -> ForkedRun:
        """Fork the run and return at once; the server takes no other request until it has ended (`wait`)."""
        assert self.running is None or self.running.returncode is not None, (
            "the server runs one run at a time"
        )
        self.started += 1
        out = self.outputs / f"{self.started}.stdout"
        err = out if merge_stderr else self.outputs / f"{self.started}.stderr"
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
        self.running = ForkedRun(self.proc.stdout, pid, out, err)
        return self.running

    def close(self) -> None:
        if self.running is not None and self.running.returncode is None:
            self.running.kill()
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.outputs, ignore_errors=True)


class ForkedRun:
    """A run the server forked, as much of a `subprocess.Popen` as a test that signals it needs: `pid` (the leader
    of its own process group), `poll`, `wait`, `send_signal`, `kill`, and its output so far (`outputs`)."""

    def __init__(self, replies, pid: int, out: Path, err: Path) -> None:
        self.replies, self.pid, self.out, self.err = replies, pid, out, err
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self._status(0)
        return self.returncode

    def wait(self, timeout: float) -> int:
        """The exit status; `subprocess.TimeoutExpired` if the run is still going after `timeout` seconds."""
        if not self._status(timeout):
            raise subprocess.TimeoutExpired(f"forked run {self.pid}", timeout)
        return self.returncode

    def _status(self, timeout: float) -> bool:
        """Whether the run has ended, reading the server's report of it within `timeout` seconds."""
        import selectors

        if self.returncode is None:
            with selectors.DefaultSelector() as selector:
                selector.register(self.replies, selectors.EVENT_READ)
                if selector.select(timeout):
                    self.returncode = json.loads(self.replies.readline())["status"]
        return self.returncode is not None

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        """The run and every process of its group (its ranks), then its status (the server takes requests again)."""
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._status(60)

    def outputs(self) -> tuple[str, str]:
        """(stdout, stderr) so far (the same text twice where stderr goes to stdout)."""
        out = self.out.read_text(errors="replace") if self.out.exists() else ""
        if self.err == self.out:
            return out, out
        return out, self.err.read_text(errors="replace") if self.err.exists() else ""


if __name__ == "__main__":
    serve()
