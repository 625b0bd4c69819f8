"""One flipped byte inside a tensor of any checkpoint format: what issue 40 found resumed silently (bytes flipped
in `archive/data/0`, the embedding, of last.ckpt), for the tests that show each reader refuses it."""

from __future__ import annotations

import io
import json
import struct
import zipfile
from pathlib import Path


def flip_a_tensor_byte(checkpoint: Path) -> Path:
    """Flip the middle byte of the largest tensor in `checkpoint`: a torch.save file, a DeepSpeed folder (its
    largest `.pt`), a DCP folder or a Hugging Face folder (model.safetensors). Returns the file changed."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_file():
        return _flip(checkpoint, *_largest_zip_tensor(checkpoint))
    if (checkpoint / "latest").is_file():
        file = max(checkpoint.rglob("*.pt"), key=lambda p: p.stat().st_size)
        return _flip(file, *_largest_zip_tensor(file))
    if (checkpoint / ".metadata").is_file():
        return _flip_dcp(checkpoint)
    return _flip(checkpoint / "model.safetensors", *_largest_safetensor(checkpoint / "model.safetensors"))


def _flip(file: Path, start: int, length: int) -> Path:
    data = bytearray(file.read_bytes())
    data[start + length // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    return file


def _largest_zip_tensor(file: Path, start: int = 0, length: int | None = None) -> tuple[int, int]:
    """(offset, length) in `file` of the largest tensor storage (`<archive>/data/<n>`) of the torch.save zip that
    fills it, or its bytes [start, start + length) (a DCP item)."""
    blob = file.read_bytes()[start : None if length is None else start + length]
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        entry = max((e for e in archive.infolist() if "/data/" in e.filename), key=lambda e: e.file_size)
    name_length, extra_length = struct.unpack(
        "<HH", blob[entry.header_offset + 26 : entry.header_offset + 30]
    )
    return start + entry.header_offset + 30 + name_length + extra_length, entry.file_size


def _flip_dcp(folder: Path) -> Path:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from parallama.checkpoint.untrusted import read_dcp_metadata

    metadata = read_dcp_metadata(folder)
    tensors = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    info = max(
        (info for index, info in metadata.storage_data.items() if index.fqn in tensors),
        key=lambda i: i.length,
    )
    file = folder / info.relative_path
    return _flip(file, *_largest_zip_tensor(file, info.offset, info.length))  # DCP torch.saves each item


def _largest_safetensor(file: Path) -> tuple[int, int]:
    with open(file, "rb") as f:
        (header_length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_length))
    begin, end = max(
        (v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda o: o[1] - o[0]
    )
    return 8 + header_length + begin, end - begin
