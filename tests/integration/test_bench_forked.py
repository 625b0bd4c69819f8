"""bench/forked.py: a `train-gpu` arm run forked from a process with the imports done is still `python -m <module>`
in its own process (argv, environment, working directory, exit status, output), and its timeout ends it with what
it started; `Forks` runs afresh what fails forked."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import forked
from bench.forked import Forks

PROGRAM = """
import os, subprocess, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE"), "lightning" in sys.modules)
print("to stderr", file=sys.stderr)
if sys.argv[1] == "hang":  # a child of its own, as the compile workers are
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open("child.pid", "w").write(str(child.pid))
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


def test_a_forked_run_is_python_m_in_its_own_process_and_its_timeout_ends_what_it_started(tmp_path):
    (tmp_path / "probe.py").write_text(PROGRAM)
    env = {**os.environ, "PROBE": "seen"}
    with pytest.raises(ValueError, match="not a `python -m <module>` line"):
        forked.run([sys.executable, "probe.py"], tmp_path, env, timeout=60)
    done = forked.run([sys.executable, "-m", "probe", "exit", "3"], tmp_path, env, timeout=60)
    assert done.returncode == 3 and done.stderr == "to stderr\n"
    # the server imported Lightning: the run did not import it again
    assert done.stdout == f"argv ['exit', '3'] cwd {tmp_path} env seen True\n"

    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, "-m", "probe", "hang", "0"], tmp_path, env, timeout=3)
    assert time.monotonic() - started < 30
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(50):  # killed with the run (its process group): gone, or a zombie until init reaps it
        if not alive(child):
            break
        time.sleep(0.1)
    assert not alive(child)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] not in "ZX"
    except FileNotFoundError:
        return False


def test_a_run_that_fails_forked_runs_afresh_and_if_that_succeeds_the_rest_start_afresh():
    """The forked start is a fresh interpreter's stand-in, never trusted over one: until a forked run has
    succeeded, a failure (not a timeout: that would only cost the same time again) is run again afresh."""
    tries = []

    def arm(outcomes):
        def go(fork):
            tries.append(fork)
            return outcomes[fork]

        return go

    works_only_afresh = {True: {"error": "CUDA error: initialization error"}, False: {"rates": [1.0]}}
    forks = Forks(True)
    assert forks.run(arm(works_only_afresh)) == {"rates": [1.0]} and tries == [True, False]
    assert not forks.on and "initialization error" in forks.note
    forks.run(arm(works_only_afresh))
    assert tries == [True, False, False]  # no more forking

    tries.clear()
    forks = Forks(True)
    broken = {True: {"error": "CUDA out of memory"}, False: {"error": "CUDA out of memory"}}
    timed_out = {True: {"error": "timed out after 150 s"}, False: {"rates": [1.0]}}
    assert forks.run(arm(timed_out)) == timed_out[True] and tries == [True]  # not run again
    assert forks.run(arm(broken)) == broken[False] and tries == [True, True, False]
    assert forks.on and forks.note is None  # the arm fails either way: forking is not to blame
    assert forks.run(arm({True: {"rates": [2.0]}})) == {"rates": [2.0]}
    assert forks.run(arm(broken)) == broken[True] and tries == [True, True, False, True, True]  # proven
