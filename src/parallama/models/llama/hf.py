"""Hugging Face Llama folders: write ours (config.json, model.safetensors, tokenizer files) and read theirs.

Key mapping: HF `LlamaForCausalLM` keys are ours with a `model.` prefix, except `lm_head.weight`. With
tied embeddings HF stores no lm_head (it ties on load), so we skip it on export and tie on import.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch import Tensor

from parallama.checkpoint.read import load_state_into
from parallama.data.tokenizer import UNK, special_ids
from parallama.errors import ConfigError
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_hf_folder(
    out_dir: str | os.PathLike, state_dict: dict[str, Tensor], config: LlamaConfig, tokenizer_json: str | None
) -> None:
    """A folder that `LlamaForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load as is."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tied = config.tie_word_embeddings
    tensors = {
        k if k == "lm_head.weight" else f"model.{k}": v.detach().float().contiguous().cpu()
        for k, v in state_dict.items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o666 & ~_umask())  # safetensors leaves its temp file's 0600
    ids = {}
    if tokenizer_json is not None:
        tok = Tokenizer.from_str(tokenizer_json)
        bot, eot, pad = special_ids(tok)
        ids = {"bos_token_id": bot, "eos_token_id": eot, "pad_token_id": pad}
        specials = {"bos_token": tok.id_to_token(bot), "eos_token": tok.id_to_token(eot)}
        specials["pad_token"] = tok.id_to_token(pad)
        if tok.token_to_id(UNK) is not None:
            specials["unk_token"] = UNK
        (out / "tokenizer.json").write_text(tokenizer_json)
        _write_json(out / "special_tokens_map.json", specials)
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": config.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            **specials,
        }
        _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "config.json", {**config.to_hf_dict(), **ids, "torch_dtype": "float32"})
    _write_json(out / "generation_config.json", ids)


def load_hf_config(path: str | os.PathLike) -> LlamaConfig:
    """Our config from a HF Llama folder's config.json; errors on variants this model cannot represent."""
    file = Path(path, "config.json")
    if not file.is_file():
        raise ConfigError(f"init_from={path} has no config.json; expected a Hugging Face Llama folder")
    d = json.loads(file.read_text())
    if d.get("model_type", "llama") != "llama":
        raise ConfigError(f"init_from={path} has model_type={d['model_type']!r}; only 'llama' is supported")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ConfigError(f"init_from={path} has {key}=true; this model has no biases")
    config = LlamaConfig.from_hf_dict(d)
    if d.get("head_dim") not in (None, config.head_dim):
        raise ConfigError(
            f"init_from={path} has head_dim={d['head_dim']} but hidden_size/num_attention_heads={config.head_dim}"
        )
    return config


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if files := sorted(folder.glob("*.safetensors")):
        return files
    raise ConfigError(
        f"init_from={folder} has no *.safetensors files (PyTorch .bin weights are not supported)"
    )


def load_hf_weights(model: Llama, path: str | os.PathLike) -> None:
    """Copy a HF Llama folder's weights into `model`, whose config must match the folder's."""
    theirs = load_hf_config(path)
    for f in fields(LlamaConfig):
        if f.name != "initializer_range" and getattr(theirs, f.name) != getattr(model.config, f.name):
            raise ConfigError(
                f"init_from={path} has {f.name}={getattr(theirs, f.name)} but model.{f.name}="
                f"{getattr(model.config, f.name)}; set model.{f.name} to match"
            )
    hf = {}
    for file in _safetensors_files(Path(path)):
        try:
            hf.update(load_file(file))
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"init_from file {file} is truncated or corrupt ({err})") from None
    ours = {k.removeprefix("model."): v for k, v in hf.items()}
    if model.config.tie_word_embeddings:
        ours["lm_head.weight"] = ours.get("embed_tokens.weight")
    load_state_into(model, ours, source=f"init_from={path}")
