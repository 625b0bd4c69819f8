"""The suite's fork server (tests/forkserver.py, tests/zygote.py) starts what a run spawns as a fork too, as an
interpreter started afresh would run it: the suite's time depends on it (docs/architecture.md, Tests)."""

from __future__ import annotations

import os

from conftest import _SERVER_ENV, LAUNCH_ENV
from forkserver import ForkServer

SPAWNER = """
import multiprocessing, os, sys, warnings


def child():
    print("child: lightning imported", "lightning" in sys.modules, flush=True)
    warnings.warn("probe-warning from the spawned child")


if __name__ == "__main__":
    os.environ["PYTHONWARNINGS"] = "ignore:probe-warning"  # as runtime/quiet.py passes its filters to children
    process = multiprocessing.get_context("spawn").Process(target=child)
    process.start()
    process.join()
    sys.exit(process.exitcode)
"""


def test_a_spawned_child_is_forked_with_the_filters_a_fresh_one_would_read(tmp_path):
    """Under PYTHONDONTWRITEBYTECODE=1 (the CI machine) multiprocessing passes `-B` on to its spawns, which the
    zygote once refused: every ddp_spawn rank was a fresh interpreter (~9 s of CPU importing Lightning). The
    spawned child is forked (Lightning already imported), and takes the PYTHONWARNINGS set before the spawn."""
    (tmp_path / "spawner.py").write_text(SPAWNER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_ENV)}
    env.update(PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    server = ForkServer({**_SERVER_ENV, "PYTHONDONTWRITEBYTECODE": "1"})
    try:
        proc = server.run("spawner", [], cwd=tmp_path, env=env, timeout=120)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "child: lightning imported True" in proc.stdout, proc.stdout
    assert "probe-warning" not in proc.stderr, proc.stderr[-3000:]
