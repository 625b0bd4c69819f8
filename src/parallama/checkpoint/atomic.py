"""Single-file checkpoints written atomically beside their target, and read weights-only.

Lightning's TorchCheckpointIO saves through fsspec: a temp file in $TMPDIR, then `shutil.move`, which is a
copy when the run directory is on another filesystem (a kill mid-copy or a full disk truncates `last.ckpt`),
and a write killed on the same filesystem leaves a checkpoint-sized `tmpXXXX` in $TMPDIR (tests/unit/
test_library_gaps.py test_lightnings_checkpoint_io_writes_in_tmpdir_then_moves). Here the temp file
is `.<name>.tmp-<pid>` in the target's own directory, hashed as it is written, fsynced, then `os.replace`d over
the target after its checksum (checkpoint/integrity.py). DeepSpeed and FSDP (distributed checkpoints) write their
folders themselves: `AtomicFolderCheckpoints` writes them beside the target, adds their checksums and swaps them in.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.io import TorchCheckpointIO

from parallama.checkpoint import integrity
from parallama.checkpoint.untrusted import load_weights_only
from parallama.errors import ConfigError
from parallama.runtime.faults import last_checkpoint_note

_TEMP = re.compile(r"\..+\.tmp-\d+")


class DiskFullError(ConfigError):
    """The disk filled up while a checkpoint was written; the previous checkpoint file is untouched."""


def disk_full(err: BaseException) -> bool:
    """Whether `err` or what it came from is "no space left on device": torch.save reports it as its zip writer's
    RuntimeError ("unexpected pos ..."), the OSError ENOSPC its context; DCP as a CheckpointException holding
    each rank's (exception, traceback) (`failures`)."""
    todo, seen = [err], set()
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        ranks = getattr(err, "failures", None)
        todo += [err.__cause__, err.__context__, *(exc for exc, _trace in (ranks or {}).values())]
    return False


def disk_full_message(path: Path) -> str:
    """The previous checkpoints are intact: the line names the newest and how to resume it (once there is room)."""
    return (
        f"no space left on the device of {path.parent} writing {path.name}; the checkpoints before it are intact "
        f"(free space there); {last_checkpoint_note(str(path.parent.parent))}"
    )


def temp_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def remove_stale_temps(dirpath: str | os.PathLike) -> list[Path]:
    """Delete temp files a killed save left in a checkpoint directory (call before training starts)."""
    stale = [p for p in Path(dirpath).glob(".*.tmp-*") if _TEMP.fullmatch(p.name) and p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


class AtomicCheckpointIO(TorchCheckpointIO):
    """`trainer.save_checkpoint` never leaves a partial file at the target, on any filesystem."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options")
        save_file(checkpoint, path)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        integrity.sidecar(path).unlink(missing_ok=True)

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only=None) -> dict:
        """Weights-only whatever the caller asks: a checkpoint may come from elsewhere."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_weights_only(path, map_location=map_location)


def save_file(checkpoint: dict, path) -> None:
    """torch.save to a temp file beside `path`, hashed as it is written, then renamed over `path` after its
    checksum: never a partial file at the target, on any filesystem."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            hashing = integrity.HashingFile(f)
            torch.save(checkpoint, hashing)
            f.flush()
            os.fsync(f.fileno())
        integrity.replace_file(tmp, path, hashing.entry())
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if disk_full(err):
            raise DiskFullError(disk_full_message(path)) from None
        raise
    _sync_directory(path.parent)


def _sync_directory(folder: Path) -> None:
    directory = os.open(folder, os.O_RDONLY)  # the renames themselves survive a power loss
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class AtomicFolderCheckpoints:
    """DeepSpeed and FSDP write a checkpoint as a folder, in place: a kill mid-write would leave a broken one.

    Write it next to the target as `<name>.partial`, add its checksums, then swap it in; until the swap the
    previous checkpoint stays whole (as `<name>` or, for an instant, `<name>.old`, which `ckpt_path=last` also
    finds). FSDP's full-state file (`save_distributed_checkpoint=false`) is a `.partial` file with its checksum,
    renamed over the target.
    """

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        path = Path(filepath)
        partial, old = path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")
        if self.is_global_zero:
            _remove(partial)
        self.barrier("parallama_ckpt_clean")
        try:
            super().save_checkpoint(checkpoint, partial, storage_options=storage_options)
            self.barrier("parallama_ckpt_written")
            if partial.is_dir():
                entries = self._hash_own_files(partial)
                if self.is_global_zero:
                    integrity.write_manifest(partial, entries)
        except BaseException as err:
            if not disk_full(err):
                raise
            _remove(partial)  # every rank: a failed write is not a collective any more
            raise DiskFullError(disk_full_message(path)) from None
        if self.is_global_zero:
            if partial.is_file():
                integrity.replace_file(partial, path, integrity.recorded(partial))
                integrity.sidecar(partial).unlink()
            else:
                _remove(old)
                if path.exists():
                    path.rename(old)
                partial.rename(path)
                _remove(old)
        self.barrier("parallama_ckpt_swapped")

    def _hash_own_files(self, folder: Path) -> dict[str, dict]:
        """Each rank hashes the files it wrote (DCP's `__<rank>_<n>.distcp`, DeepSpeed's `*rank_<rank>_*`; rank 0
        the rest), still in its page cache, in parallel with the others; every rank gets all the entries."""

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        names = integrity.folder_files(folder)
        mine = [n for n in names if _writer(n, world) == rank]
        entries = integrity.hash_files(folder, mine)
        if world == 1:
            return entries
        gathered: list = [None] * world
        dist.all_gather_object(gathered, entries)
        return {name: entry for part in gathered for name, entry in part.items()}


_RANK_IN_NAME = re.compile(r"(?:^__|_rank_)(\d+)_")  # __1_0.distcp, zero_pp_rank_1_mp_rank_00_optim_states.pt


def _writer(name: str, world: int) -> int:
    match = _RANK_IN_NAME.search(Path(name).name)
    return int(match.group(1)) % world if match else 0


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
