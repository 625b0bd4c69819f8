"""Checkpoints from elsewhere: unpickling can run code, so every pickle in one is read weights-only, with an
allow-list of the few non-tensor types each format really contains (found on real checkpoints), and anything
else is refused by name in one line.

Separate from `checkpoint`, which reads weights and client state: this is the safety layer under it and under
resuming (formats.py `verify_checkpoint` before Lightning or DeepSpeed unpickle with full pickle; `parallel.universal` and
`parallel.zero_state` read through it too). DeepSpeed and DCP unpickle with full pickle themselves, so they run
under `weights_only_loads`, and DCP's `.metadata` is read by a restricted unpickler.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, metadata
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, StorageMeta

from parallama.errors import ConfigError
from parallama.runtime.compat import dcp_metadata_private_types


def _unsafe(path: str | os.PathLike, what: str) -> ConfigError:
    return ConfigError(
        f"checkpoint {path} contains {what}, which is not allowed in a checkpoint (possible code execution); "
        "refusing to load it"
    )


def _corrupt(path: str | os.PathLike, err: Exception) -> ConfigError:
    reason = str(err).strip().split(". ")[0].splitlines()[0] if str(err).strip() else type(err).__name__
    return ConfigError(f"checkpoint {path} is truncated or corrupt ({reason})")


def deepspeed_types() -> list:
    """Non-tensor types in DeepSpeed's `*optim_states.pt` (ZeRO 1-3, fp32 and bf16; DynamicLossScaler is
    fp16's). Lightning single files, DeepSpeed model states and DCP's meta.pt need none beyond torch's."""
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; stdout is the CLIs' result
        # start-up time (deepspeed)
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum  # start-up time (deepspeed)
        from deepspeed.utils.tensor_fragment import fragment_address  # start-up time (deepspeed)
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(
    path: str | os.PathLike | io.BytesIO,
    mmap: bool = False,
    allowed: list = (),
    name=None,
    map_location="cpu",
):
    """torch.load(weights_only=True) with `allowed` types; a refused global or a broken file is one line."""
    name = name or path
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if match := re.search(r"GLOBAL (\S+)", str(err)):
            raise _unsafe(name, match.group(1)) from None
        raise _corrupt(name, err) from None
    except Exception as err:  # zip/EOF errors all mean the same to the user
        raise _corrupt(name, err) from None


@contextlib.contextmanager
def weights_only_loads(allowed: list) -> Iterator[None]:
    """Every torch.load inside is weights-only with `allowed`, also where a library asks for full pickle
    (DeepSpeed's zero_to_fp32, DCP's byte items): torch's own TORCH_FORCE_WEIGHTS_ONLY_LOAD switch."""
    saved = {
        k: os.environ.pop(k, None)
        for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    }
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(list(allowed)):
            yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _dcp_metadata_types() -> dict[tuple[str, str], object]:
    """What DCP's `.metadata` pickle holds (torch 2.13, FSDP2 via Lightning), by (module, name)."""

    types = [
        metadata.Metadata,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        torch.Size,
        type(pathlib.Path()),  # StorageMeta.checkpoint_id
        *dcp_metadata_private_types(),
    ]
    allowed = {(t.__module__, t.__qualname__): t for t in types}
    allowed.update({("torch", n): d for n in dir(torch) if isinstance(d := getattr(torch, n), torch.dtype)})
    return allowed


class _RestrictedUnpickler(pickle.Unpickler):
    """pickle with only the allow-listed globals (Python's documented way to restrict unpickling)."""

    def __init__(self, file, path: str | os.PathLike, allowed: dict[tuple[str, str], object]):
        super().__init__(file)
        self.path, self.allowed = path, allowed

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise _unsafe(self.path, f"{module}.{name}")
        return self.allowed[(module, name)]


def read_dcp_metadata(path: str | os.PathLike):
    """A DCP folder's `.metadata`, which torch reads with full pickle, through the restricted unpickler."""
    file = Path(path, ".metadata")
    try:
        with open(file, "rb") as f:
            return _RestrictedUnpickler(f, file, _dcp_metadata_types()).load()
    except ConfigError:
        raise
    except Exception as err:
        raise _corrupt(file, err) from None


def safe_dcp_reader(path: str | os.PathLike):
    """DCP's FileSystemReader with `.metadata` read by `read_dcp_metadata`."""

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_dcp_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def verify_deepspeed(path: str | os.PathLike) -> None:
    allowed = deepspeed_types()
    for file in sorted(Path(path).rglob("*.pt")):
        load_weights_only(str(file), mmap=True, allowed=allowed)


def verify_dcp(path: str | os.PathLike):
    """`.metadata`, every *.pt, and the pickled (non-tensor) items inside the `*.distcp` files; returns
    the metadata."""

    metadata = read_dcp_metadata(path)
    storage = metadata.storage_data or {}
    for file in sorted({Path(path, info.relative_path) for info in storage.values()}):
        if (
            not file.is_file()
        ):  # found: a missing shard reached the user as a raw "[Errno 2] ... __1_0.distcp"
            raise ConfigError(
                f"checkpoint {file} is missing (its .metadata names it): the checkpoint is incomplete"
            )
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue  # tensors: torch reads them weights-only itself
        info = storage.get(MetadataIndex(key))
        if info is None or info.transform_descriptors:
            raise ConfigError(f"checkpoint {path}/.metadata has no plain storage entry for {key}")
        file = Path(path, info.relative_path)
        with open(file, "rb") as f:
            f.seek(info.offset)
            blob = io.BytesIO(f.read(info.length))
        load_weights_only(blob, name=file)
    for file in sorted(Path(path).glob("*.pt")):
        load_weights_only(str(file), mmap=True)
    return metadata
