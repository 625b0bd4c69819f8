"""What a checkpoint is on disk, decided in one place, and its client state, read once.

Lightning's ModelCheckpoint writes `last.ckpt` / `stepNNNNNNN.ckpt` as one of three formats:
- `file` (auto, ddp, ddp_spawn, ddp_sharded; FSDP with `save_distributed_checkpoint=false`): a torch.save'd dict
  with `state_dict`, `optimizer_states` and the client state;
- `deepspeed`: a folder with `latest` naming a tag folder of `*model_states.pt` (rank 0's holds the client
  state) and `*optim_states.pt` (the ZeRO partitions);
- `dcp` (FSDP2): a torch.distributed.checkpoint folder (`.metadata`, `*.distcp`), tensors under `state_dict.*`
  and `optimizer_0.*`, the client state in `meta.pt`.

The client state (hyper-parameters, counters, loops, the data position, who wrote it, the W&B run id) is what
every step of a resume asks about; `client_state` reads it once per checkpoint and serves the copies.
"""

from __future__ import annotations

import copy
import os
from functools import lru_cache
from pathlib import Path

from parallama.errors import ConfigError

FORMATS = ("file", "deepspeed", "dcp")
INFO_KEY = "parallel"  # checkpoint[INFO_KEY]: who wrote it (strategy, world size, format, optimizer keys)
LIGHTNING_TENSORS = ("state_dict", "optimizer_states")  # a Lightning file's tensors, beside its client state
# What DeepSpeed's engine writes into the model-states file beside Lightning's client state
# (DeepSpeedEngine._common_checkpoint_state and _save_checkpoint).
DEEPSPEED_KEYS = (
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
    "ds_config",
    "ds_version",
)


def detect(path: str | os.PathLike) -> str:
    """`file`, `deepspeed` or `dcp`; anything else is one line naming the path."""
    path = str(path)
    if os.path.isfile(path):
        return "file"
    if os.path.exists(os.path.join(path, "latest")):
        return "deepspeed"
    if os.path.exists(os.path.join(path, ".metadata")):
        return "dcp"
    if not os.path.exists(path):
        raise ConfigError(f"ckpt_path={path} does not exist")
    raise ConfigError(
        f"ckpt_path={path} is a folder but neither a DeepSpeed checkpoint (latest) nor a distributed one (.metadata)"
    )


def deepspeed_tag(path: str | os.PathLike) -> Path:
    """The folder `latest` names inside a DeepSpeed checkpoint."""
    return Path(path, Path(path, "latest").read_text().strip())


def client_state_file(path: str | os.PathLike) -> Path | None:
    """The file that holds a checkpoint's client state (None: a folder without one)."""
    fmt = detect(path)
    if fmt == "file":
        return Path(path)
    if fmt == "deepspeed":
        files = sorted(deepspeed_tag(path).glob("*model_states.pt"))
        return files[0] if files else None
    meta = Path(path, "meta.pt")
    return meta if meta.is_file() else None


def client_state(path: str | os.PathLike) -> dict:
    """A checkpoint's non-tensor state, without its weights: read once per file (and again if it changes), once
    the checkpoint passed its checksums (the first byte of a checkpoint most readers use)."""
    from parallama.checkpoint.integrity import verify  # start-up time (hydra)

    verify(path)
    file = client_state_file(path)
    if file is None:
        return {}
    stat = file.stat()
    return copy.deepcopy(_read_client_state(str(file.resolve()), stat.st_mtime_ns, stat.st_size))


@lru_cache(maxsize=8)
def _read_client_state(file: str, mtime_ns: int, size: int) -> dict:
    from parallama.checkpoint.untrusted import load_weights_only  # torch-free module

    state = load_weights_only(file, mmap=True)  # the weights stay on disk, unread
    drop = (*LIGHTNING_TENSORS, *DEEPSPEED_KEYS)
    return copy.deepcopy({k: v for k, v in state.items() if k not in drop})  # and unmapped once read


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Before resuming with ckpt_path=<file or folder>: Lightning and DeepSpeed unpickle with full pickle,
    so check first that every pickle in it loads weights-only with the allow-list (else a one-line error)."""
    from parallama.checkpoint.integrity import verify  # start-up time (hydra)
    from parallama.checkpoint.untrusted import (  # torch-free module
        load_weights_only,
        verify_dcp,
        verify_deepspeed,
    )

    fmt = detect(path)
    verify(path)  # its checksums first: a corrupt byte is named as such, not as whatever it breaks
    check = {
        "file": lambda p: load_weights_only(p, mmap=True),
        "deepspeed": verify_deepspeed,
        "dcp": verify_dcp,
    }
    check[fmt](str(path))
