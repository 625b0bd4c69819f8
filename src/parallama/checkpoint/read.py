"""A checkpoint of any strategy as plain weights + model config + client state, for the tools that only read
(export, eval, generate): no optimizer state, one process, no process group (formats: `formats`).

Checkpoints may come from elsewhere: every pickle is read through `untrusted` (weights-only, allow-listed).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from parallama.checkpoint.formats import LIGHTNING_TENSORS, client_state, deepspeed_tag, detect
from parallama.checkpoint.untrusted import (
    deepspeed_types,
    load_weights_only,
    safe_dcp_reader,
    verify_dcp,
    verify_deepspeed,
    weights_only_loads,
)
from parallama.errors import ConfigError
from parallama.models import ModelSpec, model_spec

PREFIX = "model."  # CausalLM keeps its model at `self.model`


@dataclass
class LoadedCheckpoint:
    state_dict: dict[str, Tensor]  # the model's own keys, fp32, on CPU
    spec: ModelSpec  # its family
    config: object  # the family's config
    tokenizer_json: str | None  # None in checkpoints written before tokenizers were embedded
    meta: dict  # the rest of the client state: hyper_parameters, global_step, tokens_seen, ...


def _load_file(path: str) -> tuple[dict, dict]:
    ckpt = load_weights_only(path)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(f"checkpoint {path} is not a Lightning checkpoint (no state_dict)")
    return ckpt["state_dict"], {k: v for k, v in ckpt.items() if k not in LIGHTNING_TENSORS}


def _load_deepspeed(path: str) -> tuple[dict, dict]:
    """fp32 weights merged from the ZeRO partitions by DeepSpeed's own zero_to_fp32 (no moments, unlike
    `checkpoint.zero`, which resuming needs)."""
    tag = deepspeed_tag(path)
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO<=2, ZeRO-3
    if not any((tag / name).is_file() for name in names):
        raise ConfigError(f"checkpoint {tag} has none of {names}; the DeepSpeed checkpoint is incomplete")
    verify_deepspeed(path)
    try:
        with contextlib.redirect_stdout(sys.stderr), weights_only_loads(deepspeed_types()):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state_dict = get_fp32_state_dict_from_zero_checkpoint(path, tag.name)
    except Exception as err:
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({err})") from None
    return state_dict, client_state(path)


def _load_dcp(path: str) -> tuple[dict, dict]:
    """Read only the model's tensors, in one process, without a process group: export, eval and generate need a
    third of what `parallel.universal.read` (weights + AdamW moments, for resuming) holds in memory."""
    import torch.distributed.checkpoint as dcp

    metadata = verify_dcp(path)
    try:
        state_dict = {
            k.removeprefix("state_dict."): torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in metadata.state_dict_metadata.items()
            if k.startswith("state_dict.")
        }
        with warnings.catch_warnings(), weights_only_loads([]):
            # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"state_dict": state_dict}, storage_reader=safe_dcp_reader(path), no_dist=True)
    except Exception as err:
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({str(err).splitlines()[0]})") from None
    return state_dict, client_state(path)


def load_checkpoint(path: str | os.PathLike) -> LoadedCheckpoint:
    """Weights (the model's own keys), its family and config, tokenizer and client state of a checkpoint of any
    format."""
    path = str(path)
    load = {"file": _load_file, "deepspeed": _load_deepspeed, "dcp": _load_dcp}[detect(path)]
    state_dict, meta = load(path)
    model_kwargs = (meta.get("hyper_parameters") or {}).get("model")
    if not isinstance(model_kwargs, dict):
        raise ConfigError(f"checkpoint {path} is not a parallama checkpoint (no hyper_parameters.model)")
    spec = model_spec(model_kwargs)
    config = spec.build_config(model_kwargs)
    ours = {k.removeprefix(PREFIX): v.float() for k, v in state_dict.items() if k.startswith(PREFIX)}
    for alias, source in config.tied_parameters().items():  # some formats store a tied tensor once
        if source in ours:
            ours[alias] = ours[source]
    return LoadedCheckpoint(ours, spec, config, meta.pop("tokenizer", None), meta)


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


def load_model(ckpt_path: str | None = None, model_dir: str | None = None):
    """(model, tokenizer) from a training checkpoint (any strategy) or a Hugging Face folder (e.g. an export), for
    the tools that run a model (generate, evaluate)."""
    from tokenizers import Tokenizer

    from parallama.data.tokenizer import from_pretrained
    from parallama.models import spec_for_hf_folder

    if model_dir is not None:
        spec = spec_for_hf_folder(model_dir)
        model = spec.model(spec.hf.load_hf_config(model_dir, spec.config))
        spec.hf.load_hf_weights(model, model_dir)
        return model, from_pretrained(model_dir)
    ckpt = load_checkpoint(ckpt_path)
    if ckpt.tokenizer_json is None:
        raise ConfigError(f"checkpoint {ckpt_path} has no tokenizer (written before tokenizers were stored)")
    model = ckpt.spec.model(ckpt.config)
    load_state_into(model, ckpt.state_dict, source=f"checkpoint {ckpt_path}")
    return model, Tokenizer.from_str(ckpt.tokenizer_json)


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
