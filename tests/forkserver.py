"""Start the CLIs' processes from a process that has already imported torch and Lightning.

On the 2-core CI machine `import torch, lightning` takes ~8 s of a tiny run's ~9.5 s (lightning imports
torchmetrics, which imports transformers, scipy.signal and matplotlib; torch._dynamo), and the suite starts a few
hundred of them. Each `run_cli` is still its own process, with its own argv, environment, working directory,
exit status and stdout/stderr, run as `python -m <module>` runs it: this server forks it after the imports instead
of a fresh interpreter doing them again.

The processes such a run starts are forked the same way, and are still that run's children: `python -m
parallama.<tool> ...` through `subprocess.Popen` (the ranks parallama's launcher starts, torchrun's workers, the
sweep launcher's jobs) and multiprocessing's spawned children (ddp_spawn, the benchmarks' ranks). Before its
program runs, each forked process forks a "zygote" of itself (imports done, nothing run yet) and becomes a child
subreaper; Popen (or multiprocessing's `spawnv_passfds`) asks the zygote for the process, handing it the
descriptors the child must have, the zygote forks it through an intermediate that exits at once, and the kernel
hands the orphan to its nearest subreaper, the process that asked. That process then waits, polls and kills it as
a child it started; the child's parent is that process, as parallama's dead-rank watch expects. Anything else (a
Popen with a preexec_fn, another executable, interpreter options) starts as it always does.

The server takes one request per line on stdin (JSON: module, args, cwd, env, out, err), forks the run, answers
`{"pid": ...}` and, once the run has ended, `{"status": ...}`. `PARALLAMA_TEST_FORK=0` runs plain subprocesses.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import inspect
import json
import multiprocessing.util
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from pathlib import Path

_SITE_PATH: list[str] = []  # the server's sys.path after its own script's directory and PYTHONPATH


def serve() -> None:
    """The server: import what every CLI imports, then fork one run per request."""
    own = 1 + len([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    _SITE_PATH[:] = sys.path[own:]
    import hydra  # noqa: F401
    import lightning  # noqa: F401  (the ~8 s)
    import torch  # noqa: F401

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


def become(argv: list[str], env: dict, cwd: str, fds: dict[int, int]) -> None:
    """Be `python <argv>` (`-m <module> ...` or `-c <program> ...`) from here on, in this forked process: `fds`
    maps each descriptor it must have (stdin, stdout, stderr, any passed) to the one that holds it now. Exits
    with the program's status; never returns."""
    code = 1
    try:
        _place(fds)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        # as python builds it: the working directory first ('' under -c), then PYTHONPATH, the installation's
        sys.path[:] = [cwd if argv[0] == "-m" else "", *python_path, *_SITE_PATH]
        _fork_children_from_a_zygote()
        try:
            if argv[0] == "-m":
                sys.argv = argv[1:]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = ["-c", *argv[2:]]
                main = sys.modules["__main__"] = types.ModuleType("__main__")
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as exit:
            if exit.code is None or isinstance(exit.code, int):
                code = exit.code or 0
            else:
                print(exit.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _place(fds: dict[int, int]) -> None:
    """Give each target descriptor its file, whatever numbers the files have now (they may be each other's)."""
    above = max(fds) + 1
    moved = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, above) for target, fd in fds.items()}
    for fd in set(fds.values()):
        if fd not in fds:  # a target keeps its number until it is overwritten below
            os.close(fd)
    for target, fd in moved.items():
        os.dup2(fd, target)
        os.close(fd)


_PR_SET_CHILD_SUBREAPER = 36
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def _fork_children_from_a_zygote() -> None:
    """Fork this process's zygote, and start from it the `python -m parallama.*` commands this process gives
    `subprocess.Popen` and the children multiprocessing spawns (see the module's docstring)."""
    ours, theirs = socket.socketpair()
    dispositions = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    if os.fork() == 0:
        ours.close()
        _zygote(theirs, dispositions)  # never returns
    theirs.close()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    lock = threading.Lock()

    def fork(argv: list[str], env, cwd, fds: dict[int, int], new_session=False, process_group=-1) -> int:
        request = {
            "argv": argv,
            "env": {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
            "cwd": os.fsdecode(cwd) if cwd is not None else os.getcwd(),
            "targets": list(fds),
            "new_session": new_session,
            "process_group": process_group,
        }
        payload = json.dumps(request).encode()
        with lock:
            socket.send_fds(ours, [len(payload).to_bytes(8, "little")], list(fds.values()))
            ours.sendall(payload)
            return int.from_bytes(_read_exactly(ours, 8), "little")

    popen_execute_child = subprocess.Popen._execute_child
    signature = inspect.signature(popen_execute_child)

    def execute_child(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        argv = _parallama_command(call)
        if argv is None:
            return popen_execute_child(self, *args, **kwargs)
        child_ends = (call["p2cread"], call["c2pwrite"], call["errwrite"])
        fds = {std: fd if fd != -1 else std for std, fd in enumerate(child_ends)}
        env = call["env"] if call["env"] is not None else os.environ
        process_group = call.get("process_group", -1)
        self.pid = fork(argv, env, call["cwd"], fds, call["start_new_session"], process_group)
        self._child_created = True
        parent_ends = (call["p2cwrite"], call["c2pread"], call["errread"])
        for parent_end, child_end in zip(parent_ends, child_ends):  # as Popen closes them once the child runs
            if child_end != -1 and parent_end != -1 and child_end != getattr(self, "_devnull", None):
                os.close(child_end)
        if hasattr(self, "_devnull"):
            os.close(self._devnull)
        self._closed_child_pipe_fds = True

    spawnv_passfds = multiprocessing.util.spawnv_passfds

    def spawn(path, args, passfds):
        argv = [os.fsdecode(a) for a in args]
        spawn_main = argv[1:2] == ["-c"] and argv[2].startswith(
            "from multiprocessing.spawn import spawn_main"
        )
        if not spawn_main or not _is_this_python(os.fsdecode(path)):
            return spawnv_passfds(path, args, passfds)
        return fork(argv[1:], os.environ, None, {fd: fd for fd in (0, 1, 2, *sorted(map(int, passfds)))})

    subprocess.Popen._execute_child = execute_child
    multiprocessing.util.spawnv_passfds = spawn


def _is_this_python(path: str) -> bool:
    return os.path.realpath(path) == os.path.realpath(sys.executable)


def _parallama_command(call: dict) -> list[str] | None:
    """The argv after the interpreter of a Popen call that runs `python [-u] -m parallama.<...> ...` with nothing
    the zygote cannot do as exec would (a preexec_fn, other ids, an executable of its own), else None."""
    args = call["args"]
    if isinstance(args, (str, bytes)) or call["shell"] or call["executable"] is not None:
        return None
    if call["preexec_fn"] is not None or call["pass_fds"] or call["umask"] >= 0:
        return None
    if any(call[key] is not None for key in ("uid", "gid", "gids")):
        return None
    args = [os.fsdecode(a) for a in args]
    if not args or not _is_this_python(args[0]):
        return None
    rest = args[1:]
    if rest[:1] == ["-u"]:  # torchrun's workers: unbuffered already (PYTHONUNBUFFERED=1 in the tests)
        rest = rest[1:]
    if len(rest) < 2 or rest[0] != "-m" or not rest[1].startswith("parallama."):
        return None
    return rest


def _zygote(sock: socket.socket, dispositions: dict) -> None:
    """Fork one process per request, through an intermediate that exits at once (the process then belongs to
    the subreaper that asked); ends when the asking process closes its end."""
    for sig in _SIGNALS:  # a signal to the run's process group is for the run, not for the zygote
        signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            header, received, _, _ = socket.recv_fds(sock, 8, 64)
        except OSError:
            os._exit(0)
        if not header:
            os._exit(0)
        request = json.loads(_read_exactly(sock, int.from_bytes(header, "little")))
        pid_read, pid_write = os.pipe()
        intermediate = os.fork()
        if intermediate == 0:
            pid = os.fork()
            if pid == 0:
                sock.close()
                os.close(pid_read)
                os.close(pid_write)
                if request["new_session"]:
                    os.setsid()
                elif request["process_group"] is not None and request["process_group"] >= 0:
                    os.setpgid(0, request["process_group"])
                for sig, handler in dispositions.items():
                    signal.signal(sig, handler)
                fds = dict(zip(request["targets"], received))
                become(request["argv"], request["env"], request["cwd"], fds)
            os.write(pid_write, pid.to_bytes(8, "little"))
            os._exit(0)
        for fd in received:
            os.close(fd)
        os.close(pid_write)
        pid = _read_fd_exactly(pid_read, 8)
        os.close(pid_read)
        os.waitpid(intermediate, 0)  # the process is the subreaper's child from here on
        sock.sendall(pid)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the zygote's socket closed")
        data += chunk
    return data


def _read_fd_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise ConnectionError("the intermediate process ended without a pid")
        data += chunk
    return data


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
