"""AtomicCheckpointIO: a failed or killed save never touches the previous checkpoint and leaves no temp file,
in the checkpoint directory or in $TMPDIR; loading is weights-only."""

import os
import subprocess
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
    sidecar = path.with_name("last.ckpt.checksums.json")  # its checksum first (checkpoint/integrity.py)
    assert renames == [(temp_path(sidecar), sidecar, []), (temp_path(path), path, [])]
    assert sorted(os.listdir(path.parent)) == ["last.ckpt", "last.ckpt.checksums.json"]
    loaded = trainer.strategy.load_checkpoint(path)
    torch.testing.assert_close(loaded["state_dict"], trainer.lightning_module.state_dict())


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB filesystem (tmpfs, mounted as root): a checkpoint larger than that fills it up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (root needed): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_one_line_and_leaves_the_previous_checkpoint_intact(small_disk):
    """Found: torch.save on a full disk raises its zip writer's RuntimeError ("unexpected pos"), the OSError ENOSPC
    only in its context, which a traceback showed instead of the one line."""
    path = small_disk / "checkpoints" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(10_000)}}, path)  # 40 kB: fits
    before = path.read_bytes()
    with pytest.raises(DiskFullError) as excinfo:
        io.save_checkpoint({"state_dict": {"w": torch.ones(1_000_000)}}, path)  # 4 MB: does not
    message = str(excinfo.value)
    assert message.startswith(
        f"no space left on the device of {path.parent} writing last.ckpt; the checkpoints before"
    )
    assert "\n" not in message and isinstance(excinfo.value, ConfigError)  # train.py reports it in one line
    assert path.read_bytes() == before and sorted(os.listdir(path.parent)) == [
        "last.ckpt",
        "last.ckpt.checksums.json",
    ]


def test_a_full_disk_during_a_folder_checkpoint_is_one_line_too(small_disk):
    """DCP folders (fsdp, model_parallel) are written as `<name>.partial` and swapped in: on a full disk the
    partial folder goes and the previous checkpoint stays."""
    import torch.distributed.checkpoint as dcp

    from parallama.checkpoint.atomic import AtomicFolderCheckpoints

    class DCPWriter:  # what FSDP2's strategy does with the path it is given, in one process
        is_global_zero = True

        def barrier(self, name=None):
            pass

        def save_checkpoint(self, checkpoint, filepath, storage_options=None):
            dcp.save(checkpoint, checkpoint_id=str(filepath), no_dist=True)

    class Folders(AtomicFolderCheckpoints, DCPWriter):
        pass

    path = small_disk / "checkpoints" / "last.ckpt"
    Folders().save_checkpoint({"w": torch.ones(10_000)}, path)
    with pytest.raises(DiskFullError) as excinfo:
        Folders().save_checkpoint({"w": torch.ones(1_000_000)}, path)
    assert str(excinfo.value).startswith(f"no space left on the device of {path.parent} writing last.ckpt")
    assert os.listdir(path.parent) == ["last.ckpt"] and (path / ".metadata").is_file()
    assert (path / "checksums.json").is_file()


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
