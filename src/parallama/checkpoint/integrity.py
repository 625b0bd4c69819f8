"""Checksums in every checkpoint a run writes, checked before any byte of one is used.

- A single file (`last.ckpt`, `step*.ckpt`, `parallama-ckpt convert format=file`): its size and sha256, hashed
  while torch.save writes it (`HashingFile`), in the sidecar `<name>.checksums.json`.
- A folder (DCP, DeepSpeed, the Hugging Face export): `checksums.json` inside it, each file's size and sha256,
  written once the folder is whole and before it is swapped in (each rank hashes the files it wrote, still in
  its page cache: checkpoint/atomic.py).

`verify` (a resume, the tools, `parallama-ckpt convert`) compares sizes, then digests, and refuses a mismatch in
one line naming the file; `problem` says the same without raising (`ckpt_path=last` skips to the next
checkpoint). A checkpoint without checksums (written before they were recorded) loads, with one line saying so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from functools import cache, lru_cache
from pathlib import Path

from parallama.errors import ConfigError
from parallama.runtime.launch import first_process

log = logging.getLogger("parallama")

# hashlib's sha256: the fastest library hash on CPUs with SHA extensions (x86 SHA-NI, ARMv8), ~3x blake2b's
# speed there (bench/checksum.py: 1.0 against 0.35 GB/s a core), and `sha256sum` recomputes any digest by hand.
ALGORITHM = "sha256"
MANIFEST = "checksums.json"  # inside a folder checkpoint
SIDECAR = ".checksums.json"  # beside a single file: <name>.checksums.json
_CHUNK = 1 << 20


class HashingFile:
    """A binary file whose writes are hashed on the way (torch.save takes any object with `write`): the digest
    is ready when the file is, without reading it back. Inline, in the writing thread: on a 2-core VM a hashing
    thread beside the writes (with a copy of each piece: the writer may reuse its buffer) was slower, not faster."""

    def __init__(self, file) -> None:
        self.file, self.hash, self.size = file, hashlib.new(ALGORITHM), 0

    def write(self, data) -> int:
        self.hash.update(data)
        written = self.file.write(data)
        self.size += written
        return written

    def flush(self) -> None:
        self.file.flush()

    def entry(self) -> dict:
        return {"bytes": self.size, ALGORITHM: self.hash.hexdigest()}


def file_entry(path: str | os.PathLike) -> dict:
    """A file's size and digest, read in chunks (hashlib releases the GIL: threads hash files in parallel)."""
    digest, buffer = hashlib.new(ALGORITHM), bytearray(_CHUNK)
    view, size = memoryview(buffer), 0
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return {"bytes": size, ALGORITHM: digest.hexdigest()}


def hash_files(folder: str | os.PathLike, names: list[str]) -> dict[str, dict]:
    """{name: entry} of the files `names` (relative to `folder`), hashed in parallel."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda name: file_entry(Path(folder, name)), names)))


def folder_files(folder: str | os.PathLike) -> list[str]:
    """Every file under `folder` but its manifest, relative, sorted."""
    root = Path(folder)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: str | os.PathLike, entries: dict[str, dict]) -> None:
    """The folder's `checksums.json`, synced to disk; the folder is still private (`.partial`, or an export
    being written)."""
    _write_synced(Path(folder, MANIFEST), {"algorithm": ALGORITHM, "files": dict(sorted(entries.items()))})


def checksum_folder(folder: str | os.PathLike) -> None:
    """Hash every file of a finished folder and write its manifest (one process: a converted or exported one)."""
    write_manifest(folder, hash_files(folder, folder_files(folder)))


def sidecar(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + SIDECAR)


def replace_file(tmp: Path, path: Path, entry: dict) -> None:
    """`os.replace(tmp, path)` with its sidecar written first, naming the new content and the one it replaces:
    a kill between the two renames leaves a file that checks against it either way."""
    previous = (_read_manifest(sidecar(path)) or {}).get("files", {}).get(path.name)
    record = {"algorithm": ALGORITHM, "files": {path.name: entry}}
    if previous is not None and previous != entry:
        record["replaces"] = {path.name: previous}
    temp = sidecar(path).with_name(f".{sidecar(path).name}.tmp-{os.getpid()}")  # atomic.py's temp naming
    try:
        _write_synced(temp, record)
        os.replace(temp, sidecar(path))
    finally:
        temp.unlink(missing_ok=True)
    os.replace(tmp, path)


def recorded(file: Path) -> dict:
    """The entry a single file's sidecar holds for it."""
    return _read_manifest(sidecar(file))["files"][file.name]


def has_checksums(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / MANIFEST).is_file() if path.is_dir() else sidecar(path).is_file()


def problem(path: str | os.PathLike) -> str | None:
    """Why the checkpoint at `path` (a file or a folder) fails its checksums, in a phrase naming the file;
    None when it passes or has none (`has_checksums`). Cached per version of its files: a resume asks in the
    config check and again in the run."""
    path = Path(path).resolve()
    manifest = path / MANIFEST if path.is_dir() else sidecar(path)
    if not manifest.is_file():
        return None
    return _problem(str(path), _stamp(path, manifest))


def verify(path: str | os.PathLike, note_missing: bool = True) -> None:
    """Raise the one line of a checkpoint that fails its checksums; say once, in one line, that one without
    any is not checked (`note_missing=False`: Hugging Face folders from elsewhere, which never have them)."""
    if (found := problem(path)) is not None:
        raise ConfigError(found)
    if note_missing and not has_checksums(path):
        path = Path(path).resolve()
        note_once(f"checkpoint {path} carries no checksums (written before they were recorded): not verified")


@cache
def note_once(line: str) -> None:
    """A note the config check and the run would both give (they read the same checkpoint): once, by the
    job's first process."""
    if first_process():
        log.warning(line)


def _stamp(path: Path, manifest: Path) -> tuple:
    """What identifies this version of the checkpoint's files without reading them."""
    files = [manifest, *(p for p in ([path] if path.is_file() else sorted(path.rglob("*"))) if p != manifest)]
    return tuple((str(p), s.st_size, s.st_mtime_ns) for p in files if (s := _stat(p)) is not None)


def _stat(path: Path):
    try:
        return path.stat()
    except OSError:
        return None


@lru_cache(maxsize=32)
def _problem(path: str, stamp: tuple) -> str | None:
    root = Path(path)
    manifest = root / MANIFEST if root.is_dir() else sidecar(root)
    record = _read_manifest(manifest)
    if record is None or not isinstance(record.get("files"), dict) or record.get("algorithm") != ALGORITHM:
        return f"checkpoint {manifest} is not a readable {ALGORITHM} checksum list (corrupt)"
    if root.is_file():
        accepted = [
            e for e in (record["files"].get(root.name), record.get("replaces", {}).get(root.name)) if e
        ]
        if not accepted:
            return f"checkpoint {manifest} has no checksum for {root.name}"
        entry = file_entry(root)
        if entry in accepted:
            return None
        return _mismatch(root, entry["bytes"], accepted[0], manifest)
    expected = record["files"]
    for name, entry in expected.items():  # the cheap checks first: a missing or truncated file reads nothing
        file = root / name
        if not file.is_file():
            return f"checkpoint {file} is missing (listed in {manifest})"
        if file.stat().st_size != entry.get("bytes"):
            return _mismatch(file, file.stat().st_size, entry, manifest)
    found = hash_files(root, list(expected))
    for name, entry in expected.items():
        if found[name] != entry:
            return _mismatch(root / name, found[name]["bytes"], entry, manifest)
    return None


def _mismatch(file: Path, size: int, expected: dict, manifest: Path) -> str:
    if size != expected.get("bytes"):
        return (
            f"checkpoint {file} is {size} bytes but was written with {expected.get('bytes')} ({manifest}): "
            "truncated or overwritten"
        )
    return (
        f"checkpoint {file} is corrupt: its {ALGORITHM} differs from the one {manifest} recorded when it was "
        "written"
    )


def _read_manifest(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _write_synced(path: Path, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
