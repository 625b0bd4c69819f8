"""What a resume continues, and what it refuses: extending a finished run, a changed LR, changed data order,
another data-parallel size or batch size (continued at the same global sample).

One 6-step run (`finished`) is shared by the tests; each resume is one more single-process run.
"""

from __future__ import annotations

import csv
import json
import re
import shutil

import pytest
import torch
from conftest import train

from parallama.data.position import saved_position
from parallama.errors import ConfigError

# A constant LR, so that a run's schedule does not depend on its length: extending a run is then comparable
# with a run that was that long from the start (with the default cosine the longer run's schedule differs).
CONSTANT_LR = ["scheduler.warmup_steps=0", "scheduler.min_lr_ratio=1", "trainer.val_check_interval=3"]


def weights(ckpt) -> dict:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def rows(run_dir) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def data_state(ckpt) -> dict:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["TextDataModule"]


def trained(index_log) -> list[tuple[int, list[int]]]:
    return [(r["epoch"], r["indices"]) for r in map(json.loads, index_log.read_text().splitlines())]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_cache):
    """6 steps of 1 process x batch 4, with its index log (`run/indices.jsonl`)."""
    tmp = tmp_path_factory.mktemp("finished")
    log = f"data.index_log={tmp / 'run' / 'indices.jsonl'}"
    train(*CONSTANT_LR, "trainer.max_steps=6", log, cwd=tmp, cache=data_cache, run_dir=tmp / "run")
    return tmp / "run"


def test_extending_a_finished_run_in_its_directory_equals_running_longer(finished, tmp_path, data_cache):
    """The end-of-run checkpoint is taken at the last step, so a higher max_steps continues the same epoch; resumed
    in its own directory (`ckpt_path=last`), the run appends to its metrics history."""
    train(*CONSTANT_LR, "trainer.max_steps=12", cwd=tmp_path, cache=data_cache, run_dir=tmp_path / "straight")
    extended = tmp_path / "extended"
    shutil.copytree(finished, extended)
    before = {int(r["step"]) for r in rows(extended) if r["train/loss"]}
    proc = train(
        *CONSTANT_LR,
        "trainer.max_steps=12",
        "ckpt_path=last",
        cwd=tmp_path,
        cache=data_cache,
        run_dir=extended,
    )
    assert "not resumable" not in proc.stdout + proc.stderr  # Lightning's warning: the data module resumes
    expected = weights(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    actual = weights(extended / "checkpoints" / "last.ckpt")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name
    after = {int(r["step"]) for r in rows(extended) if r["train/loss"]}
    assert before == set(range(1, 7)) and after == set(range(1, 13))  # the first run's history is kept


def test_a_new_lr_applies_on_resume(finished, tmp_path, data_cache):
    proc = train(
        *CONSTANT_LR,
        "trainer.max_steps=8",
        "optimizer.lr=1e-4",
        f"ckpt_path={finished / 'checkpoints' / 'last.ckpt'}",
        cwd=tmp_path,
        cache=data_cache,
        run_dir=tmp_path / "run",
    )
    assert "resuming with optimizer.lr=0.0001 (the checkpoint's run had 0.003)" in proc.stdout + proc.stderr
    lrs = [float(r["lr-AdamW/pg1"]) for r in rows(tmp_path / "run") if r.get("lr-AdamW/pg1")]
    assert lrs and all(lr == pytest.approx(1e-4) for lr in lrs)


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.seq_len=32", "was trained with data.seq_len=64 but this run has 32"),
        ("seed=3", "was trained with seed=42 but this run has 3"),
        ("trainer.max_steps=6", "is at step 6 and trainer.max_steps=6: nothing is left to train"),
    ],
)
def test_a_resume_that_would_change_the_data_order_is_refused(
    finished, tmp_path, data_cache, override, message
):
    proc = train(
        *CONSTANT_LR,
        "trainer.max_steps=12",
        override,
        f"ckpt_path={finished / 'checkpoints' / 'last.ckpt'}",
        cwd=tmp_path,
        cache=data_cache,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert message in out and "Traceback" not in out
    assert len([line for line in out.splitlines() if "error:" in line]) == 1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"packing": False}, "with data.packing=True but this run has False"),
        ({"val_fraction": 0.1}, "with data.val_fraction=0.05 but this run has 0.1"),
    ],
)
def test_every_data_order_key_is_checked(tmp_path, change, message):
    """The same check as above, in-process, for the keys the command-line cases leave out."""
    saved = _datamodule(tmp_path)._order()
    with pytest.raises(ConfigError, match=re.escape(message)):
        _datamodule(tmp_path, **change).check_resume(saved, source="ckpt")


def test_batch_size_and_world_size_are_not_checked_and_older_positions_convert(tmp_path):
    """A per-rank position from before global positions continues if it names its world size (consumed x
    world size); without the world size it is refused in one line."""
    world = "world size (trainer.devices x trainer.num_nodes)"
    old = {**_datamodule(tmp_path)._order(), "epoch": 1, "consumed": 8, "data.batch_size": 4, world: 2}
    _datamodule(tmp_path, batch_size=2).check_resume(old, source="ckpt")
    assert saved_position(old, "ckpt") == (1, 16)
    del old[world]
    with pytest.raises(ConfigError, match="ckpt stores its data position per rank without its world size"):
        _datamodule(tmp_path).check_resume(old, source="ckpt")


def _datamodule(tmp_path, **kwargs):
    from functools import partial

    from parallama.data import TextDataModule, byte_level, embedded

    args = dict(seq_len=64, batch_size=4, cache_dir=str(tmp_path))
    return TextDataModule(partial(embedded, max_documents=12), byte_level, **{**args, **kwargs})
