"""Hugging Face Qwen3-MoE folders: the Llama's hf.py (models/llama/hf.py: config.json, tokenizer, the check that
every tensor has its place) with the experts converted. In memory, as in transformers 5, each block's experts are
two stacked tensors (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I)); on disk, as in
the Hub's checkpoints and what transformers' `save_pretrained` writes, one `gate_proj`, `up_proj` and `down_proj`
per expert (`mlp.experts.<e>.gate_proj.weight`).
"""

from __future__ import annotations

import os
import re

import torch
from torch import Tensor

from parallama.errors import ConfigError
from parallama.models.llama import hf as llama_hf
from parallama.models.llama.hf import load_hf_config  # noqa: F401  (the family's hf module offers it)

_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def per_expert(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Fused expert tensors split into the per-expert ones of a checkpoint on disk; the rest as is."""
    out = {}
    for name, tensor in state_dict.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for e, weight in enumerate(tensor):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = weight
            else:
                gate, up = weight.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return out


def fused(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert tensors stacked into the fused ones (the inverse of `per_expert`)."""
    out, experts = {}, {}
    for name, tensor in state_dict.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            prefix, e, kind = match.groups()
            experts.setdefault(prefix, {}).setdefault(kind, {})[int(e)] = tensor
    for prefix, kinds in experts.items():
        stack = {kind: [by_index[e] for e in sorted(by_index)] for kind, by_index in kinds.items()}
        if len({len(v) for v in stack.values()}) != 1 or len(stack) != 3:
            raise ConfigError(f"{prefix}: each expert needs its gate_proj, up_proj and down_proj")
        pairs = zip(stack["gate_proj"], stack["up_proj"])
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in pairs])
        out[f"{prefix}.down_proj"] = torch.stack(stack["down_proj"])
    return out


def save_hf_folder(out_dir: str | os.PathLike, state_dict: dict[str, Tensor], config, tokenizer_json) -> None:
    """A folder `Qwen3MoeForCausalLM.from_pretrained` loads as is; a router transformers does not run (sigmoid
    scores, a loss-free balancing bias) or any tensor without a place is one line, before anything is written."""
    if config.router_score_func != "softmax":
        raise ConfigError(
            f"export: model.router_score_func={config.router_score_func} has no Qwen3MoeForCausalLM equivalent "
            "(its router is a softmax); train with the default to export"
        )
    llama_hf.save_hf_folder(out_dir, per_expert(state_dict), config, tokenizer_json)


def load_hf_weights(model, path: str | os.PathLike) -> None:
    """Copy a Qwen3-MoE folder's weights into `model` (the Llama's reader, the experts stacked)."""
    llama_hf.load_hf_weights(model, path, convert=fused)
