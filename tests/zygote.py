"""How a process forked by tests/forkserver.py becomes `python <argv>`, and how it starts its own children.

The processes a forked run starts are forked the same way, and are still that run's children: `python -m
parallama.<tool> ...` through `subprocess.Popen` (the ranks parallama's launcher starts, torchrun's workers, the
sweep launcher's jobs) and multiprocessing's spawned children (ddp_spawn, the benchmarks' ranks). Before its
program runs, each forked process forks a "zygote" of itself (imports done, nothing run yet) and becomes a child
subreaper; Popen (or multiprocessing's `spawnv_passfds`) asks the zygote for the process, handing it the
descriptors the child must have, the zygote forks it through an intermediate that exits at once, and the kernel
hands the orphan to its nearest subreaper, the process that asked. That process then waits, polls and kills it as
a child it started; the child's parent is that process, as parallama's dead-rank watch expects. Anything else (a
Popen with a preexec_fn, another executable, interpreter options) starts as it always does.
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
import shlex
import signal
import socket
import subprocess
import sys
import threading
import traceback
import types
import warnings

import setproctitle

setproctitle.getproctitle()  # set up now, while the environment is the one exec gave (become() replaces it)

# The server's sys.path after its own script's directory and PYTHONPATH (forkserver.serve sets it).
SITE_PATH: list[str] = []


def become(argv: list[str], env: dict, cwd: str, fds: dict[int, int]) -> None:
    """Be `python <argv>` (`-m <module> ...` or `-c <program> ...`) from here on, in this forked process: `fds`
    maps each descriptor it must have (stdin, stdout, stderr, any passed) to the one that holds it now. Exits
    with the program's status; never returns."""
    code = 1
    try:
        _place(fds)
        os.environ.clear()
        os.environ.update(env)
        _apply_warning_options(env)
        os.chdir(cwd)
        python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        # as python builds it: the working directory first ('' under -c), then PYTHONPATH, the installation's
        sys.path[:] = [cwd if argv[0] == "-m" else "", *python_path, *SITE_PATH]
        _fork_children_from_a_zygote()
        # what `ps` and psutil show: the command this process is, not the server's (tests look for a run's ranks)
        setproctitle.setproctitle(shlex.join([sys.executable, *argv]))
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


def _apply_warning_options(env: dict) -> None:
    """What an interpreter started with `env` does first: PYTHONWARNINGS's filters. A fork has the filters of the
    process it was forked from, taken before that process set the variable for its children (runtime/quiet.py:
    the warnings a spawned rank gives before it runs any of parallama's code)."""
    new = [
        option
        for option in env.get("PYTHONWARNINGS", "").split(",")
        if option and option not in sys.warnoptions
    ]
    sys.warnoptions.extend(new)
    warnings._processoptions(new)


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

    # multiprocessing passes on this interpreter's flags (-B under PYTHONDONTWRITEBYTECODE=1): the zygote has them
    own_flags = subprocess._args_from_interpreter_flags()

    def spawn(path, args, passfds):
        argv = [os.fsdecode(a) for a in args]
        if argv[1 : 1 + len(own_flags)] == own_flags:
            argv = [argv[0], *argv[1 + len(own_flags) :]]
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
