"""A checkpoint of any strategy as plain weights + model config + client state, for the tools that only read
(export, eval, generate): no optimizer state, one process, no process group (read by `universal.read`, the one
reader of every format).

Checkpoints may come from elsewhere: every pickle is read through `untrusted` (weights-only, allow-listed).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from parallama.checkpoint import universal
from parallama.checkpoint.formats import LIGHTNING_TENSORS
from parallama.checkpoint.integrity import verify
from parallama.errors import ConfigError
from parallama.models import ModelSpec, model_spec, spec_for_hf_folder
from parallama.models.contract import load_state_into

PREFIX = "model."  # CausalLM keeps its model at `self.model`


@dataclass
class LoadedCheckpoint:
    state_dict: dict[str, Tensor]  # the model's own keys, fp32, on CPU
    spec: ModelSpec  # its family
    config: object  # the family's config
    tokenizer_json: str | None  # None in checkpoints written before tokenizers were embedded
    meta: dict  # the rest of the client state: hyper_parameters, global_step, tokens_seen, ...


def load_checkpoint(path: str | os.PathLike) -> LoadedCheckpoint:
    """Weights (the model's own keys), its family and config, tokenizer and client state of a checkpoint of any
    format."""
    path = str(path)
    state = universal.read(path, optimizer=False)
    state_dict, meta = state.model, {k: v for k, v in state.client.items() if k not in LIGHTNING_TENSORS}
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


def load_model(ckpt_path: str | None = None, model_dir: str | None = None):
    """(model, tokenizer) from a training checkpoint (any strategy) or a Hugging Face folder (e.g. an export), for
    the tools that run a model (generate, evaluate)."""
    from tokenizers import Tokenizer  # start-up time (tokenizers)

    from parallama.tokenizer import from_pretrained  # start-up time (tokenizers)

    if model_dir is not None:
        verify(model_dir, note_missing=False)  # an export's checksums (a folder from the Hub has none)
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
