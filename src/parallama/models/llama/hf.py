"""Hugging Face folders of the Llama and of the families shaped like it (models/qwen3): write ours (config.json,
model.safetensors, tokenizer files) and read theirs. The family is its config's class (`LlamaConfig` or a
subclass): it names the folder's model_type and architecture and the tensors its checkpoints hold.

Key mapping: HF `LlamaForCausalLM` keys are ours with a `model.` prefix, except `lm_head.weight`. With
tied embeddings HF stores no lm_head (it ties on load), so we skip it on export and tie on import. A tensor the
family's HF checkpoint does not have (or lacks) is refused: transformers would drop (or re-initialize) it.

Not transformers' save_pretrained/from_pretrained: transformers is an optional extra (`export`), so a training
environment without it still exports (test_without_transformers_export_says_it_cannot_verify) and init_from reads
a folder without building a second model. tests/integration/test_export.py: the folder loads in transformers with
equal logits and tokens (test_export_loads_in_transformers), and a folder save_pretrained wrote, sharded too,
reads back with equal logits (test_load_hf_weights_matches_transformers).
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from torch import Tensor

from parallama.errors import ConfigError
from parallama.models.contract import load_state_into
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.tokenizer import UNK, special_ids


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_hf_folder(
    out_dir: str | os.PathLike, state_dict: dict[str, Tensor], config: LlamaConfig, tokenizer_json: str | None
) -> None:
    """A folder that `AutoModelForCausalLM.from_pretrained` (the config's `hf_architecture`) and
    `AutoTokenizer.from_pretrained` load as is; a state dict that does not map onto that checkpoint's tensors
    exactly is one line naming the tensor, before anything is written."""
    tied = config.tie_word_embeddings
    names = {
        k if k == "lm_head.weight" else f"model.{k}": k
        for k in state_dict
        if not (tied and k == "lm_head.weight")
    }
    family, expected = f"a {config.hf_architecture} checkpoint", config.hf_keys()
    if extra := sorted(names.keys() - expected):
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError(
            f"export: the model's {names[extra[0]]}{more} has no place in {family} (transformers would drop it "
            f"silently); the family's HF mapping ({type(config).__name__}.hf_keys) does not cover it"
        )
    if missing := sorted(expected - names.keys()):
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(
            f"export: the model has no {missing[0]}{more}, which {family} holds (transformers would "
            "initialize it at random)"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf: state_dict[k].detach().float().contiguous().cpu() for hf, k in names.items()}
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
        # Every training document starts with BOS: the exported tokenizer adds it too, so that `tokenizer(text)`
        # in transformers gives what the model was trained on (parallama encodes with add_special_tokens=False)
        bos = tok.id_to_token(bot)
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bot)]
        )
        (out / "tokenizer.json").write_text(tok.to_str())
        _write_json(out / "special_tokens_map.json", specials)
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": config.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": True,
            **specials,
        }
        _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "config.json", {**config.to_hf_dict(), **ids, "torch_dtype": "float32"})
    _write_json(out / "generation_config.json", ids)


def load_hf_config(path: str | os.PathLike, config_class: type[LlamaConfig] = LlamaConfig) -> LlamaConfig:
    """Our config (of the family's `config_class`) from a HF folder's config.json; errors on variants this model
    cannot represent."""
    file = Path(path, "config.json")
    kind = config_class.hf_model_type
    if not file.is_file():
        raise ConfigError(f"init_from={path} has no config.json; expected a Hugging Face {kind} folder")
    d = json.loads(file.read_text())
    if d.get("model_type", kind) != kind:
        raise ConfigError(f"init_from={path} has model_type={d['model_type']!r}; this family reads {kind!r}")
    for key, why in [
        ("attention_bias", "has no biases"),
        ("mlp_bias", "has no biases"),
        ("use_sliding_window", "attends to every earlier token"),
    ]:
        if d.get(key):
            raise ConfigError(f"init_from={path} has {key}=true; this model {why}")
    config = config_class.from_hf_dict(d)
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


def load_hf_weights(model: Llama, path: str | os.PathLike, *, convert=None) -> None:
    """Copy a HF folder's weights into `model`, whose config must match the folder's (read as the model's config
    class: its family's model_type and fields, but those that change training only, `training_fields`).
    `convert`: the family's mapping of the folder's tensors (our names) onto its own (models/qwen3_moe)."""
    theirs = load_hf_config(path, type(model.config))
    for f in fields(theirs):
        if f.name not in theirs.training_fields and getattr(theirs, f.name) != getattr(model.config, f.name):
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
    if convert is not None:
        ours = convert(ours)
    if model.config.tie_word_embeddings:
        ours["lm_head.weight"] = ours.get("embed_tokens.weight")
    load_state_into(model, ours, source=f"init_from={path}")
