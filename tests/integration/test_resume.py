"""Long-run safety: kill -9 mid-epoch, then resume, must lose and repeat nothing (signals: test_faults.py)."""

from __future__ import annotations

import csv
import re
import shutil
import signal
import time

import pytest
import torch
from conftest import LONG, TINY, one_cycle_rates, output_of, run_cli, start_cli, train, tree_digest, weights
from corruption import flip_a_tensor_byte


def checkpoint_step(ckpt) -> int:
    try:
        return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    except Exception:  # not written yet
        return -1


def start_training(tmp_path, cache, run_dir, *args, fresh: bool = False):
    args = [*TINY, *LONG, f"paths.cache_dir={cache}", f"hydra.run.dir={run_dir}", *args]
    return start_cli("parallama.cli.train", *args, cwd=tmp_path, fresh=fresh)


def wait_for_checkpoint(proc, ckpt, min_step: int, timeout: float = 240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        step = checkpoint_step(ckpt) if ckpt.exists() else -1
        if step >= min_step:
            return step
        assert proc.poll() is None, f"training ended before step {min_step}:\n{output_of(proc)[-3000:]}"
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
    proc.wait(60)
    assert 6 <= killed_at < 40, f"killed at step {killed_at}: the poll fell behind the run"

    train(*LONG, "ckpt_path=last", cwd=tmp_path, cache=data_cache, run_dir=run)  # finds this run's last.ckpt
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == 40
    for name, tensor in expected.items():
        assert torch.equal(final["state_dict"][name], tensor), name  # bitwise: no batch repeated or skipped


def test_a_torch_scheduler_follows_torchs_curve_and_resumes_mid_run_exactly(tmp_path, data_cache):
    """scheduler=one_cycle (torch's OneCycleLR): its total_steps and max_lr the run's (6 steps, optimizer.lr), each
    step at the rate torch gives it; resumed from step 4's checkpoint, steps 5 and 6 take the same rates (the
    scheduler's state, not a new one) and end with the same weights, bitwise. Resumed into a longer run, which the
    saved total_steps would stop at step 6, it is one line."""
    args = ["scheduler=one_cycle", "trainer.max_steps=6", "trainer.val_check_interval=4",
            "validate_before_training=false", "callbacks.model_checkpoint.save_top_k=-1",
            "sample.max_new_tokens=0"]  # fmt: skip
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(*args, cwd=tmp_path, cache=data_cache, run_dir=straight)
    step_4 = straight / "checkpoints" / "step0000004.ckpt"  # written at step 4's validation
    train(*args, f"ckpt_path={step_4}", cwd=tmp_path, cache=data_cache, run_dir=resumed)

    expected = one_cycle_rates(6, max_lr=3e-3, pct_start=0.3, div_factor=25.0, final_div_factor=1e4)
    for run, steps in [(straight, range(1, 7)), (resumed, range(5, 7))]:
        with open(run / "csv" / "metrics.csv") as f:
            rates = {
                int(r["step"]): float(r["lr-AdamW/pg1"]) for r in csv.DictReader(f) if r.get("lr-AdamW/pg1")
            }
        assert rates == pytest.approx({step: expected[step - 1] for step in steps}, rel=1e-6), run.name
    finished = weights(resumed / "checkpoints" / "last.ckpt")
    for name, tensor in weights(straight / "checkpoints" / "last.ckpt").items():
        assert torch.equal(finished[name], tensor), name

    longer = train(
        *args, "trainer.max_steps=8", f"ckpt_path={step_4}", cwd=tmp_path, cache=data_cache, check=False
    )
    errors = [line for line in (longer.stdout + longer.stderr).splitlines() if "error:" in line]
    assert longer.returncode == 2 and errors, longer.stderr[-3000:]
    assert errors[0].endswith(f"error: ckpt_path={step_4} has an LR scheduler of 6 steps (its total_steps, which it "
                              "keeps) and trainer.max_steps=8 is longer; resume with trainer.max_steps=6")  # fmt: skip


def one_error(proc) -> str:
    """The run was refused before training: exit 2, one error line and nothing else of note."""
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "error:" in line]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "Restoring states" not in out and "train/loss" not in out, out[-3000:]
    return errors[0]


def test_ckpt_path_last_never_resumes_another_run(tiny_run, tmp_path, data_cache):
    """Found: a run killed before its first checkpoint, then `ckpt_path=last`, resumed an unrelated run, the
    newest under logs/. Neither a new run directory nor the killed run's own resumes it: one line, no training."""
    earlier = tmp_path / "logs" / "train" / "runs" / "2000-01-01_00-00-00-000000"
    shutil.copytree(tiny_run.dir, earlier)  # an unrelated finished run, where runs without hydra.run.dir go
    before = {p: p.read_bytes() for p in earlier.rglob("*") if p.is_file()}
    killed = tmp_path / "logs" / "train" / "runs" / "killed"
    (killed / ".hydra").mkdir(parents=True)  # what a run killed before its first checkpoint leaves
    for args, run in [(["ckpt_path=last"], None), (["ckpt_path=last"], killed)]:
        proc = train(*args, cwd=tmp_path, cache=data_cache, run_dir=run, check=False)
        line = one_error(proc)
        assert "ckpt_path=last: this run's directory " in line and " has no checkpoint (looked for " in line
        assert "or drop ckpt_path to start afresh" in line
    assert {p: p.read_bytes() for p in earlier.rglob("*") if p.is_file()} == before


def test_a_corrupt_checkpoint_is_refused_by_name_and_last_falls_back_to_an_intact_one(
    tiny_run, tmp_path, data_cache
):
    """Found: bytes flipped inside the embedding's entry of last.ckpt resumed silently (and an intact
    step*.ckpt sat unused beside it). Named explicitly it is refused in one line; `ckpt_path=last` says it skips
    it and resumes the newest intact one."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run.dir, run)
    last = run / "checkpoints" / "last.ckpt"
    flip_a_tensor_byte(last)
    proc = train(f"ckpt_path={last}", "trainer.max_steps=5", cwd=tmp_path, cache=data_cache, check=False)
    assert one_error(proc).endswith(f"error: checkpoint {last} is corrupt: its sha256 differs from the one "
                                    f"{last}.checksums.json recorded when it was written")  # fmt: skip
    (intact,) = (run / "checkpoints").glob("step*.ckpt")  # the best by val/loss, at last.ckpt's step
    one_step = ["trainer.max_steps=5", "sample.max_new_tokens=0"]
    resumed = train(*one_step, "ckpt_path=last", cwd=tmp_path, cache=data_cache, run_dir=run)
    out = resumed.stdout + resumed.stderr
    assert (
        f"ckpt_path=last: resuming {intact}; skipped: checkpoint {last} is corrupt: its sha256 differs" in out
    )
    assert f"Restoring states from the checkpoint path at {intact}" in out
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == 5  # written anew, whole


def test_nan_loss_stops_with_the_step_and_the_last_good_checkpoint(tmp_path, data_cache):
    proc = train("+model.initializer_range=1e30", cwd=tmp_path, cache=data_cache, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert re.search(
        r"error: train/loss is (nan|inf) at step \d+: .*\(no checkpoint was written yet: nothing to resume",
        out,
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
    one line; once it has stopped, `ckpt_path=<its run dir>` resumes it."""
    run = tmp_path / "logs" / "train" / "runs" / "alive"
    proc = start_training(tmp_path, data_cache, run, fresh=True)  # the others run while it lives
    try:
        wait_for_checkpoint(proc, run / "checkpoints" / "last.ckpt", min_step=3)
        proc.send_signal(signal.SIGSTOP)  # alive but paused: it cannot finish while the others start
        time.sleep(0.5)  # stopped for sure: nothing of its own changes its directory below
        before = tree_digest(run)
        for args, needle in [
            ([f"hydra.run.dir={run}", "ckpt_path=last"], f"hydra.run.dir={run} belongs to a live run (pid "),
            ([f"ckpt_path={run}"], f"ckpt_path={run} is a run that is still alive (pid "),
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
        proc.wait(120)
        out = output_of(proc)
    assert proc.returncode == 0, out[-3000:]
    assert not (run / ".owner.json").exists()  # released at its end
    resumed = train(f"ckpt_path={run}", "trainer.max_steps=41", cwd=tmp_path, cache=data_cache)
    assert f"{run}" in resumed.stdout + resumed.stderr
