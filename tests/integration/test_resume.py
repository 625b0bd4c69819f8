"""Long-run safety: kill -9 mid-epoch, then resume, must lose and repeat nothing (signals: test_faults.py)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import LONG, TINY, run_cli, train, tree_digest, weights


def checkpoint_step(ckpt) -> int:
    try:
        return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    except Exception:  # not written yet
        return -1


def start_training(tmp_path, cache, run_dir, *args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "parallama.cli.train",
        *TINY,
        *LONG,
        f"paths.cache_dir={cache}",
        f"hydra.run.dir={run_dir}",
        *args,
    ]
    return subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_for_checkpoint(proc, ckpt, min_step: int, timeout: float = 240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        step = checkpoint_step(ckpt) if ckpt.exists() else -1
        if step >= min_step:
            return step
        assert proc.poll() is None, f"training ended before step {min_step}:\n{proc.stdout.read()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step >= {min_step} within {timeout}s")


def test_kill_9_then_resume_equals_uninterrupted_bitwise(tmp_path, data_cache):
    train(*LONG, cwd=tmp_path, cache=data_cache, run_dir=tmp_path / "straight")
    expected = weights(tmp_path / "straight" / "checkpoints" / "last.ckpt")

    run = tmp_path / "killed"
    proc = start_training(tmp_path, data_cache, run)
    wait_for_checkpoint(proc, run / "checkpoints" / "last.ckpt", min_step=6)
    proc.send_signal(signal.SIGSTOP)  # frozen: the step read below is the one the kill leaves behind
    killed_at = checkpoint_step(run / "checkpoints" / "last.ckpt")
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert 6 <= killed_at < 40, f"killed at step {killed_at}: the poll fell behind the run"

    train(*LONG, "ckpt_path=last", cwd=tmp_path, cache=data_cache, run_dir=run)  # finds this run's last.ckpt
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == 40
    for name, tensor in expected.items():
        assert torch.equal(final["state_dict"][name], tensor), name  # bitwise: no batch repeated or skipped


def test_ckpt_path_last_finds_the_newest_earlier_run(tiny_run, tmp_path, data_cache):
    earlier = tmp_path / "logs" / "train" / "runs" / "2000-01-01_00-00-00-000000"
    shutil.copytree(tiny_run.dir, earlier)  # a finished run where a run without hydra.run.dir writes
    second = train("trainer.max_steps=6", "ckpt_path=last", cwd=tmp_path, cache=data_cache)
    out = second.stdout + second.stderr
    found = earlier.relative_to(tmp_path) / "checkpoints" / "last.ckpt"  # logged relative to the working dir
    assert f"Restoring states from the checkpoint path at {found}\n" in out
    (own,) = set(earlier.parent.iterdir()) - {earlier}  # this run's own directory, beside the earlier one
    assert (own / "checkpoints" / "last.ckpt").is_file()


def test_nan_loss_stops_with_the_step_and_the_last_good_checkpoint(tmp_path, data_cache):
    proc = train("+model.initializer_range=1e30", cwd=tmp_path, cache=data_cache, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert re.search(
        r"error: train/loss is (nan|inf) at step \d+: .*\(no checkpoint was written yet\)", out
    ), out[-2000:]
    assert "Traceback" not in out


@pytest.fixture
def finished(tiny_run):
    """One finished TINY run (conftest's), read (never written) by the tests below."""
    return tiny_run.dir


def test_truncated_checkpoint_names_the_file(finished, tmp_path):
    broken = tmp_path / "broken.ckpt"
    data = (finished / "checkpoints" / "last.ckpt").read_bytes()
    broken.write_bytes(data[: len(data) // 2])
    proc = run_cli(
        "parallama.cli.export", f"ckpt_path={broken}", f"out_dir={tmp_path / 'hf'}", cwd=tmp_path, check=False
    )
    assert proc.returncode == 2 and f"{broken}" in proc.stderr and "truncated or corrupt" in proc.stderr


def test_resuming_a_checkpoint_of_another_model_shape_is_refused(finished, tmp_path, data_cache):
    proc = train(
        "model.hidden_size=128",
        f"ckpt_path={finished / 'checkpoints' / 'last.ckpt'}",
        cwd=tmp_path,
        cache=data_cache,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert (
        proc.returncode == 2
        and "was trained with model.hidden_size=64 but this run has model.hidden_size=128" in out
    )
    assert "Traceback" not in out


def test_a_run_directory_belongs_to_one_live_run(tmp_path, data_cache):
    """Found: two runs in one directory both exited 0 (the first one's last.ckpt overwritten, metrics.csv
    interleaved), and `ckpt_path=last` resumed a run that was still writing. While the first run lives, both are
    one line; once it has stopped, `ckpt_path=last` resumes it."""
    run = tmp_path / "logs" / "train" / "runs" / "alive"  # where ckpt_path=last looks from tmp_path
    proc = start_training(tmp_path, data_cache, run)
    try:
        wait_for_checkpoint(proc, run / "checkpoints" / "last.ckpt", min_step=3)
        proc.send_signal(signal.SIGSTOP)  # alive but paused: it cannot finish while the others start
        time.sleep(0.5)  # stopped for sure: nothing of its own changes its directory below
        before = tree_digest(run)
        for args, needle in [
            ([f"hydra.run.dir={run}", "ckpt_path=last"], f"hydra.run.dir={run} belongs to a live run (pid "),
            ([f"hydra.run.dir={tmp_path / 'second'}", "ckpt_path=last"], "whose run is still alive (pid "),
        ]:
            second = train(*args, cwd=tmp_path, cache=data_cache, check=False)
            assert second.returncode == 2, second.stderr[-2000:]
            errors = [line for line in (second.stdout + second.stderr).splitlines() if "error:" in line]
            assert len(errors) == 1 and needle in errors[0], errors
        assert tree_digest(run) == before  # found: its .hydra/ rewritten, the refusal in its train.log
        assert proc.poll() is None  # the first run goes on
    finally:
        proc.send_signal(signal.SIGTERM)  # it saves last.ckpt at its next step and exits 0
        proc.send_signal(signal.SIGCONT)
        out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert not (run / ".owner.json").exists()  # released at its end
    resumed = train("ckpt_path=last", "trainer.max_steps=41", cwd=tmp_path, cache=data_cache)
    assert f"{run}" in resumed.stdout + resumed.stderr
