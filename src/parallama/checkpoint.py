"""Read any strategy's training checkpoint into plain weights + config, and the key=value CLI plumbing
shared by parallama-export and parallama-generate.

Formats (Lightning's ModelCheckpoint writes `last.ckpt` / `stepNNNNNNN.ckpt` as one of):
- a file (auto, ddp, ddp_spawn, ddp_sharded): torch.save'd dict with `state_dict` and client state;
- a DeepSpeed folder (`latest`, `<tag>/*model_states.pt`, `<tag>/*optim_states.pt`): fp32 weights are
  rebuilt from the ZeRO partitions, client state is in the rank-0 model-states file;
- a torch.distributed.checkpoint folder (FSDP2, `.metadata`, `*.distcp`): tensors under `state_dict.*`
  and `optimizer_0.*`, client state in `meta.pt`.

Checkpoints may come from elsewhere, and unpickling can run code: every pickle is read weights-only, with
an allow-list of the few non-tensor types each format really contains (found on real checkpoints), and
anything else is refused by name. DeepSpeed and DCP unpickle with full pickle themselves, so they run
under `weights_only_loads` and their files are verified first.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import Tensor, nn

from parallama.errors import ConfigError
from parallama.model import LlamaConfig

PREFIX = "model."  # LlamaLM keeps its Llama at `self.model`


@dataclass
class LoadedCheckpoint:
    state_dict: dict[str, Tensor]  # our Llama keys, fp32, on CPU
    config: LlamaConfig
    tokenizer_json: str | None  # None in checkpoints written before tokenizers were embedded
    meta: dict  # the rest of the client state: hyper_parameters, global_step, tokens_seen, ...


# --- weights-only loading --------------------------------------------------------------------------


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
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
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
    from torch.distributed.checkpoint import metadata

    from parallama.compat import dcp_metadata_private_types

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


def _safe_dcp_reader(path: str | os.PathLike):
    """DCP's FileSystemReader with `.metadata` read by `read_dcp_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_dcp_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _verify_deepspeed(path: str | os.PathLike) -> None:
    allowed = deepspeed_types()
    for file in sorted(Path(path).rglob("*.pt")):
        load_weights_only(str(file), mmap=True, allowed=allowed)


def _verify_dcp(path: str | os.PathLike):
    """`.metadata`, every *.pt, and the pickled (non-tensor) items inside the `*.distcp` files; returns
    the metadata."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    metadata = read_dcp_metadata(path)
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue  # tensors: torch reads them weights-only itself
        info = (metadata.storage_data or {}).get(MetadataIndex(key))
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


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Before resuming with ckpt_path=<file or folder>: Lightning and DeepSpeed unpickle with full pickle,
    so check first that every pickle in it loads weights-only with the allow-list (else a one-line error)."""
    path = str(path)
    if os.path.isfile(path):
        load_weights_only(path, mmap=True)
    elif os.path.exists(os.path.join(path, "latest")):
        _verify_deepspeed(path)
    elif os.path.exists(os.path.join(path, ".metadata")):
        _verify_dcp(path)
    else:
        raise ConfigError(
            f"ckpt_path={path} is neither a checkpoint file, a DeepSpeed checkpoint (latest) nor a distributed one (.metadata)"
        )


# --- reading weights and client state --------------------------------------------------------------


def _load_file(path: str) -> tuple[dict, dict]:
    ckpt = load_weights_only(path)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(f"checkpoint {path} is not a Lightning checkpoint (no state_dict)")
    meta = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    return ckpt["state_dict"], meta


def _load_deepspeed(path: str) -> tuple[dict, dict]:
    """fp32 weights merged from the ZeRO partitions by DeepSpeed's own zero_to_fp32 (no moments, unlike
    `parallel.zero_state`, which resuming needs)."""
    tag = Path(path, "latest").read_text().strip()
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO<=2, ZeRO-3
    files = [f for name in names if (f := Path(path, tag, name)).is_file()]
    if not files:
        raise ConfigError(
            f"checkpoint {path}/{tag} has none of {names}; the DeepSpeed checkpoint is incomplete"
        )
    _verify_deepspeed(path)
    client = load_weights_only(files[0])
    try:
        with contextlib.redirect_stdout(sys.stderr), weights_only_loads(deepspeed_types()):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state_dict = get_fp32_state_dict_from_zero_checkpoint(path, tag)
    except Exception as err:
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({err})") from None
    drop = ("module", "optimizer", "lr_scheduler", "param_shapes", "frozen_param_shapes", "shared_params")
    return state_dict, {k: v for k, v in client.items() if k not in drop}


def _load_dcp(path: str) -> tuple[dict, dict]:
    """Read only the model's tensors, in one process, without a process group: export, eval and generate need a
    third of what `parallel.universal.read` (weights + AdamW moments, for resuming) holds in memory."""
    import torch.distributed.checkpoint as dcp

    metadata = _verify_dcp(path)
    try:
        state_dict = {
            k.removeprefix("state_dict."): torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in metadata.state_dict_metadata.items()
            if k.startswith("state_dict.")
        }
        with warnings.catch_warnings(), weights_only_loads([]):
            # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"state_dict": state_dict}, storage_reader=_safe_dcp_reader(path), no_dist=True)
    except Exception as err:
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({str(err).splitlines()[0]})") from None
    meta_file = Path(path, "meta.pt")
    return state_dict, load_weights_only(meta_file) if meta_file.is_file() else {}


def read_client_state(path: str | os.PathLike) -> dict:
    """A checkpoint's non-tensor state (hyper_parameters, counters, tokenizer), without reading the weights."""
    path = str(path)
    if os.path.isfile(path):
        ckpt = load_weights_only(path, mmap=True)  # tensors stay on disk
        return {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    if os.path.exists(os.path.join(path, "latest")):
        tag = Path(path, "latest").read_text().strip()
        files = sorted(Path(path, tag).glob("*model_states.pt"))
        return load_weights_only(files[0], mmap=True) if files else {}
    meta_file = Path(path, "meta.pt")
    return load_weights_only(meta_file) if meta_file.is_file() else {}


def check_resumable(path: str | os.PathLike, model: dict) -> None:
    """Resuming needs the same model shape; say which field differs instead of a state-dict traceback."""
    saved = (read_client_state(path).get("hyper_parameters") or {}).get("model")
    if not isinstance(saved, dict):
        raise ConfigError(f"ckpt_path={path} is not a parallama checkpoint (no hyper_parameters.model)")
    for key, value in LlamaConfig(**saved).__dict__.items():
        if model.get(key, value) != value:
            raise ConfigError(
                f"ckpt_path={path} was trained with model.{key}={value} but this run has model.{key}={model[key]}; "
                "resume with the checkpoint's model settings"
            )


def load_checkpoint(path: str | os.PathLike) -> LoadedCheckpoint:
    """Weights (our Llama keys), model config, tokenizer and client state of a checkpoint of any format."""
    path = str(path)
    if not os.path.exists(path):
        raise ConfigError(f"ckpt_path={path} does not exist")
    if os.path.isfile(path):
        state_dict, meta = _load_file(path)
    elif os.path.exists(os.path.join(path, "latest")):
        state_dict, meta = _load_deepspeed(path)
    elif os.path.exists(os.path.join(path, ".metadata")):
        state_dict, meta = _load_dcp(path)
    else:
        raise ConfigError(
            f"ckpt_path={path} is a folder but neither a DeepSpeed checkpoint (latest) nor a distributed one (.metadata)"
        )
    model_kwargs = (meta.get("hyper_parameters") or {}).get("model")
    if not isinstance(model_kwargs, dict):
        raise ConfigError(f"checkpoint {path} is not a parallama checkpoint (no hyper_parameters.model)")
    config = LlamaConfig(**model_kwargs)
    ours = {k.removeprefix(PREFIX): v.float() for k, v in state_dict.items() if k.startswith(PREFIX)}
    if config.tie_word_embeddings and "embed_tokens.weight" in ours:
        ours["lm_head.weight"] = ours["embed_tokens.weight"]  # some formats store a tied tensor once
    return LoadedCheckpoint(ours, config, meta.pop("tokenizer", None), meta)


def load_state_into(model: nn.Module, state_dict: dict[str, Tensor], source: str = "checkpoint") -> None:
    """load_state_dict with a one-line error naming the first key that does not fit `model`."""
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key not in state_dict:
            raise ConfigError(f"{source} has no {key}; it is not from this model (architecture differs)")
        if state_dict[key].shape != tensor.shape:
            raise ConfigError(
                f"{source} has {key} of shape {tuple(state_dict[key].shape)} but the model expects "
                f"{tuple(tensor.shape)}; set model.* to the checkpoint's shape"
            )
    if extra := sorted(set(state_dict) - set(expected)):
        raise ConfigError(f"{source} has {extra[0]}, which the model does not have (architecture differs)")
    model.load_state_dict(state_dict)


def run_config_path(ckpt_path: str | os.PathLike) -> Path:
    """<run>/checkpoints/<ckpt> -> <run>/resolved_config.yaml."""
    return Path(ckpt_path).resolve().parent.parent / "resolved_config.yaml"


def run_config(ckpt_path: str | os.PathLike) -> DictConfig | None:
    """The training run's resolved_config.yaml as plain values: it travels with the checkpoint, so an
    interpolation in it is refused, not resolved."""
    path = run_config_path(ckpt_path)
    if not path.is_file():
        return None
    try:
        cfg = OmegaConf.load(path)
    except Exception as err:
        raise ConfigError(f"{path} is not a readable YAML config ({str(err).splitlines()[0]})") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path} is not a mapping of config keys")
    for key, value in _leaves(OmegaConf.to_container(cfg, resolve=False)):
        if isinstance(value, str) and "${" in value:
            raise ConfigError(f"{path} has {key}={value}, an interpolation; it must hold plain values")
    return cfg


def _leaves(node, prefix: str = "") -> Iterator[tuple[str, object]]:
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    if not items:
        yield prefix, node
    for key, value in items:
        yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))


# --- key=value command lines -------------------------------------------------------------------


def usage(doc: str, defaults: dict) -> str:
    """--help text: the tool's module docstring and its keys with their defaults."""
    keys = "\n".join(f"  {key}={'null' if value is None else repr(value)}" for key, value in defaults.items())
    return f"{doc.strip()}\n\nKeys (defaults):\n{keys}"


def parse_cli(defaults: dict, argv: list[str] | None, required: tuple[str, ...] = ()) -> DictConfig:
    """`key=value` args over `defaults`; unknown keys and missing required ones are ConfigErrors."""
    from parallama.checks import _did_you_mean

    args = sys.argv[1:] if argv is None else argv
    valid = f"valid keys: {', '.join(defaults)}"
    if bad := [a for a in args if "=" not in a]:
        raise ConfigError(f"argument {bad[0]!r} is not key=value; {valid}")
    cfg = OmegaConf.create(defaults)
    for arg in args:
        if (key := arg.split("=", 1)[0]) not in defaults:
            raise ConfigError(f"unknown or invalid key {key!r}{_did_you_mean(key, cfg)}; {valid}")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(args))
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid argument ({str(err).splitlines()[0]}); {valid}") from None
    if missing := [k for k in required if cfg[k] is None]:
        raise ConfigError(f"{missing[0]}= is required; {valid}")
    return cfg


def run_cli(fn, argv: list[str] | None, help_text: str) -> None:
    """Run a CLI body: -h/--help prints `help_text`; bad input prints `error: <message>` and exits 2."""
    args = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(args):
        print(help_text)
        sys.exit(0)
    try:
        fn(args)
    except (ValueError, FileNotFoundError) as err:  # ConfigError and the model's own checks
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
