"""Model families, one folder each: `models/<family>/` holds the family's config (hyper-parameters with Hugging
Face field names), the model, its Hugging Face conversion and its parallelize plan, and its `__init__` declares
them in a `ModelSpec` named `SPEC`. A model config (conf/model/*.yaml) names its family with `family: llama`;
a family outside this package is given by its module path (`family: mypackage.models.gpt`), so a second
family is one folder (its `__init__` with the config and SPEC, `model.py`, `parallelize.py`, and `hf.py` for
Hugging Face folders) plus one conf/model file.

A family shaped like the Llama reuses its parts instead of copying them (models/qwen3, the worked example): its
config subclasses `LlamaConfig` (fields, `check_head_dim`, `block_params`, `attention_activations`,
`layer_weights`, `hf_model_type`, `hf_architecture`), its model subclasses `Llama` and replaces a part by class attribute (`Llama.decoder_layer`,
`DecoderLayer.attention`, `DecoderLayer.feed_forward`, `Attention.project`), its parallelize plan is the Llama's
with its own `block_plan`, and its SPEC points `hf_path` at the Llama's hf.py, which takes the family from the
config class.

What the rest of parallama asks of a family (see models/llama/ for the reference), typed in models/contract.py
(`DecoderModel`, `ModelConfig`: checked when a config is read and a model built, one line naming what is missing):
- the config: a dataclass that checks itself when built (ValueError naming the `model.<key>`), with
  `num_params()`, `flops_per_token(seq_len)`, `tied_parameters()`, `block_params()` (one block's matmul and
  norm parameters), `attention_activations()` (what one block's attention saves per token) and the fields of a Llama-style decoder that parallama-plan reads (`vocab_size`,
  `hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
  `head_dim`, `max_position_embeddings`);
- the model: `model(config)`, whose parameters are named as in the family's Hugging Face checkpoints,
  `forward(input_ids, attention_mask=None, *, position_ids=None, document_ids=None, input_pos=None,
  kv_cache=None) -> logits`, `init_weights()`, `new_kv_cache(batch, max_len)` (see `models.generation`), its
  blocks in `layers` and the names of its `input_modules`, `output_modules` and `shared_modules`, by which
  distributed/blocks.py and distributed/stages.py checkpoint, compile, shard and split any family;
- `parallelize(model, options)`: apply the strategy's `parallel.ParallelizeOptions` in the documented order; a
  parameter its tensor-parallel plan does not cover is refused in one line, never trained as a plain tensor;
- optionally, HF conversion (export, init_from, generating from an exported folder): `save_hf_folder` (refusing
  a tensor the family's HF checkpoint has no place for, or lacks), `load_hf_config(path, config_class)`,
  `load_hf_weights(model, path)`, and the `hf_model_type` of the folders it reads.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from parallama.errors import ConfigError
from parallama.models.contract import check_config

DEFAULT_FAMILY = "llama"  # checkpoints written before families existed are Llamas


@dataclass(frozen=True)
class ModelSpec:
    """A family: its config class (torch-free: read where no model is built, e.g. by the config checks) and, by
    module path, imported on first use (they bring torch), its model class, parallelize plan and HF module."""

    family: str
    config: type
    model_path: str  # "package.module.Class"
    parallelize_path: str  # "package.module.function"
    hf_path: str | None = None  # a module with save_hf_folder, load_hf_config, load_hf_weights (None: none)
    hf_model_type: str | None = None  # config.json's model_type of the family's Hugging Face folders

    @property
    def model(self) -> type:
        return _attribute(self.model_path)

    @property
    def parallelize(self) -> Callable:
        return _attribute(self.parallelize_path)

    @property
    def hf(self) -> ModuleType:
        if self.hf_path is None:
            raise ConfigError(
                f"model.family={self.family} has no Hugging Face conversion (its SPEC's hf_path)"
            )
        return importlib.import_module(self.hf_path)

    def build_config(self, model: Mapping):
        """The family's config from a model config (conf/model or a checkpoint's hyper-parameters): a bad value
        or an unknown field is one line naming the key."""

        try:
            config = self.config(**{k: v for k, v in model.items() if k != "family"})
        except TypeError as err:  # an unknown field
            name = self.config.__name__
            raise ConfigError(f"model: {err}; valid fields are {name}'s (Hugging Face names)") from None
        except ValueError as err:
            raise ConfigError(str(err)) from None
        check_config(config, self.family)
        return config

    def shapes(self, model: Mapping):
        """(the family's model on the meta device, its config): what checks and plans read of a model's linears
        and parameters before any is allocated."""
        import torch  # torch-free module: the command line's checks need torch only for a model's shapes

        config = self.build_config(model)
        with torch.device("meta"):
            return self.model(config), config


def model_spec(model: Mapping) -> ModelSpec:
    """The spec of the family a model config names (`family`, default llama): a folder of this package, else
    a module of that name anywhere on the Python path."""
    family = model.get("family") or DEFAULT_FAMILY
    module = None
    for name in [family] if "." in family else [f"{__name__}.{family}", family]:
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as err:
            if err.name is None or not name.startswith(err.name):
                raise  # the family's own imports failed: show it
    if module is None:
        raise ConfigError(
            f"model.family={family} is not a model family; valid: {', '.join(families())} "
            "(or the module path of one outside parallama)"
        )
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, ModelSpec):
        raise ConfigError(
            f"model.family={family}: {module.__name__} has no SPEC (a parallama.models.ModelSpec)"
        )
    return spec


def _attribute(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def families() -> list[str]:
    """The families in this package (each folder under models/)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def spec_for_hf_folder(path: str | os.PathLike) -> ModelSpec:
    """The family that reads a Hugging Face folder, by its config.json's `model_type` (the default family's
    reader reports a folder without one)."""
    file = Path(path, "config.json")
    model_type = json.loads(file.read_text()).get("model_type") if file.is_file() else None
    specs = [model_spec({"family": family}) for family in families()]
    for spec in specs:
        if model_type in (None, spec.hf_model_type) and (model_type or spec.family == DEFAULT_FAMILY):
            return spec
    known = ", ".join(spec.hf_model_type for spec in specs if spec.hf_model_type)
    raise ConfigError(f"{path} has model_type={model_type!r}, which no family reads; supported: {known}")
