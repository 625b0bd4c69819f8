"""AtomicCheckpointIO: a failed or killed save never touches the previous checkpoint and leaves no temp file,
in the checkpoint directory or in $TMPDIR; loading is weights-only."""

import errno
import os
import tempfile

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from parallama.checkpoint.atomic import AtomicCheckpointIO, DiskFullError, remove_stale_temps, temp_path
from parallama.errors import ConfigError


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A real Trainer with the plugin (as train.py wires it), after one step of Lightning's BoringModel."""
    trainer = Trainer(
        accelerator="cpu",
        max_steps=1,
        plugins=[AtomicCheckpointIO()],
        default_root_dir=tmp_path_factory.mktemp("boring"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    return trainer


def test_save_writes_beside_the_target_never_in_tmpdir(trainer, tmp_path, monkeypatch):
    """$TMPDIR on another filesystem (/dev/shm is tmpfs) sees nothing; the temp is renamed in place."""
    shm = tempfile.mkdtemp(dir="/dev/shm")
    monkeypatch.setenv("TMPDIR", shm)
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read $TMPDIR
    renames, replace = [], os.replace

    def spy(src, dst):
        renames.append((src, dst, os.listdir(shm)))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    path = tmp_path / "checkpoints" / "last.ckpt"
    try:
        trainer.save_checkpoint(path)
        assert os.listdir(shm) == []
    finally:
        os.rmdir(shm)
    assert renames == [(temp_path(path), path, [])]
    assert os.listdir(path.parent) == ["last.ckpt"]
    loaded = trainer.strategy.load_checkpoint(path)
    torch.testing.assert_close(loaded["state_dict"], trainer.lightning_module.state_dict())


def test_a_full_disk_leaves_the_previous_checkpoint_intact(trainer, tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    before = path.read_bytes()

    def full_disk(obj, f):  # the disk fills up after some bytes are written
        f.write(before[:4096])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(DiskFullError) as excinfo:
        trainer.save_checkpoint(path)
    assert str(excinfo.value) == f"no space left writing {path}; the previous checkpoint is intact"
    assert isinstance(excinfo.value, ConfigError)  # train.py reports it in one line
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["last.ckpt"]


def test_an_interrupted_save_removes_its_temp_file(trainer, tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"

    def interrupted(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(path)
    assert os.listdir(tmp_path) == []


def test_remove_stale_temps_removes_only_this_naming(tmp_path):
    stale = [tmp_path / ".last.ckpt.tmp-123", tmp_path / ".step0000100.ckpt.tmp-9"]
    kept = [
        tmp_path / "last.ckpt",
        tmp_path / ".hidden",
        tmp_path / "last.ckpt.tmp-1",
        tmp_path / ".x.tmp-abc",
    ]
    for path in stale + kept:
        path.write_bytes(b"x")
    assert sorted(remove_stale_temps(tmp_path)) == sorted(stale)
    assert sorted(tmp_path.iterdir()) == sorted(kept)


def test_load_is_weights_only(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.makedirs, (str(marker),)

    torch.save({"state_dict": {}, "x": Payload()}, tmp_path / "evil.ckpt")
    with pytest.raises(ConfigError, match="evil.ckpt contains os.makedirs, which is not allowed"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "evil.ckpt", weights_only=False)
    assert not marker.exists()
