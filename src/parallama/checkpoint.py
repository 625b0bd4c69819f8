"""Read any strategy's training checkpoint into plain weights + config, and the key=value CLI plumbing
shared by parallama-export / -eval / -generate.

Formats (Lightning's ModelCheckpoint writes `last.ckpt` / `stepNNNNNNN.ckpt` as one of):
- a file (auto, ddp, ddp_spawn, ddp_sharded): torch.save'd dict with `state_dict` and client state;
- a DeepSpeed folder (`latest`, `<tag>/*model_states.pt`, `<tag>/*optim_states.pt`): fp32 weights are
  rebuilt from the ZeRO partitions, client state is in the rank-0 model-states file;
- a torch.distributed.checkpoint folder (FSDP2, `.metadata`, `*.distcp`): tensors under `state_dict.*`
  and `optimizer_0.*`, client state in `meta.pt`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
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


def _torch_load(path: str | Path, mmap: bool = False) -> dict:
    """Weights-only unpickling: Lightning's client state is plain containers, so nothing needs allow-listing."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # zip/pickle/EOF errors all mean the same to the user
        reason = str(err).strip().split(". ")[0].splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({reason})") from None


def _load_file(path: str) -> tuple[dict, dict]:
    ckpt = _torch_load(path)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(f"checkpoint {path} is not a Lightning checkpoint (no state_dict)")
    meta = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    return ckpt["state_dict"], meta


def _load_deepspeed(path: str) -> tuple[dict, dict]:
    tag = Path(path, "latest").read_text().strip()
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO<=2, ZeRO-3
    files = [f for name in names if (f := Path(path, tag, name)).is_file()]
    if not files:
        raise ConfigError(
            f"checkpoint {path}/{tag} has none of {names}; the DeepSpeed checkpoint is incomplete"
        )
    client = _torch_load(files[0])
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; stdout is the CLIs' result
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state_dict = get_fp32_state_dict_from_zero_checkpoint(path, tag)
    except Exception as err:
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({err})") from None
    drop = ("module", "optimizer", "lr_scheduler", "param_shapes", "frozen_param_shapes", "shared_params")
    return state_dict, {k: v for k, v in client.items() if k not in drop}


def _load_dcp(path: str) -> tuple[dict, dict]:
    """Read only the model's tensors (not the optimizer's), in one process, without a process group."""
    import torch.distributed.checkpoint as dcp

    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
        state_dict = {
            k.removeprefix("state_dict."): torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in metadata.state_dict_metadata.items()
            if k.startswith("state_dict.")
        }
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"state_dict": state_dict}, checkpoint_id=path, no_dist=True)
    except Exception as err:
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({str(err).splitlines()[0]})") from None
    meta_file = Path(path, "meta.pt")
    return state_dict, _torch_load(meta_file) if meta_file.is_file() else {}


def read_client_state(path: str | os.PathLike) -> dict:
    """A checkpoint's non-tensor state (hyper_parameters, counters, tokenizer), without reading the weights."""
    path = str(path)
    if os.path.isfile(path):
        ckpt = _torch_load(path, mmap=True)  # tensors stay on disk
        return {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    if os.path.exists(os.path.join(path, "latest")):
        tag = Path(path, "latest").read_text().strip()
        files = sorted(Path(path, tag).glob("*model_states.pt"))
        return _torch_load(files[0], mmap=True) if files else {}
    meta_file = Path(path, "meta.pt")
    return _torch_load(meta_file) if meta_file.is_file() else {}


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


def run_config(ckpt_path: str | os.PathLike) -> DictConfig | None:
    """The training run's resolved_config.yaml: <run>/checkpoints/<ckpt> -> <run>/resolved_config.yaml."""
    path = Path(ckpt_path).resolve().parent.parent / "resolved_config.yaml"
    return OmegaConf.load(path) if path.is_file() else None


# --- key=value command lines -------------------------------------------------------------------


def parse_cli(defaults: dict, argv: list[str] | None, required: tuple[str, ...] = ()) -> DictConfig:
    """`key=value` args over `defaults`; unknown keys and missing required ones are ConfigErrors."""
    args = sys.argv[1:] if argv is None else argv
    if bad := [a for a in args if "=" not in a]:
        raise ConfigError(f"argument {bad[0]!r} is not key=value; valid keys: {', '.join(defaults)}")
    cfg = OmegaConf.create(defaults)
    OmegaConf.set_struct(cfg, True)
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(args))
    except OmegaConfBaseException as err:
        key = err.full_key if getattr(err, "full_key", None) else str(err).splitlines()[0]
        raise ConfigError(f"unknown or invalid key {key!r}; valid keys: {', '.join(defaults)}") from None
    OmegaConf.set_struct(cfg, False)  # callers may fill in derived keys
    if missing := [k for k in required if cfg[k] is None]:
        raise ConfigError(f"{missing[0]}= is required; valid keys: {', '.join(defaults)}")
    return cfg


def run_cli(fn, argv: list[str] | None) -> None:
    """Run a CLI body: bad input prints `error: <message>` and exits 2, without a traceback."""
    try:
        fn(argv)
    except (ValueError, FileNotFoundError) as err:  # ConfigError and the model's own checks
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
