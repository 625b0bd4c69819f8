"""`parallama-generate (ckpt_path=<checkpoint> | model_dir=<exported HF folder>) prompt="..." [max_new_tokens=N]
[temperature=T] [top_k=K] [top_p=P] [seed=S]`: sample a continuation (KV cache, stops at end of text).
temperature=0 is greedy, hence deterministic."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from parallama.checkpoint.read import load_checkpoint, load_state_into
from parallama.cli.keyvalue import parse_cli, run_cli, usage
from parallama.data.tokenizer import from_pretrained, special_ids
from parallama.errors import ConfigError
from parallama.models import spec_for_hf_folder
from parallama.models.generation import generate

DEFAULTS = {
    "ckpt_path": None,
    "model_dir": None,
    "prompt": "The ",
    "max_new_tokens": 100,
    "temperature": 0.8,
    "top_k": 40,
    "top_p": None,
    "seed": 42,
    "device": None,  # null: cuda when available
}


def load_model(cfg) -> tuple[torch.nn.Module, Tokenizer]:
    """From a training checkpoint (any strategy) or from a Hugging Face folder (e.g. parallama-export's)."""
    if (cfg.ckpt_path is None) == (cfg.model_dir is None):
        raise ConfigError("give exactly one of ckpt_path=<checkpoint> or model_dir=<Hugging Face folder>")
    if cfg.model_dir is not None:
        spec = spec_for_hf_folder(cfg.model_dir)
        model = spec.model(spec.hf.load_hf_config(cfg.model_dir))
        spec.hf.load_hf_weights(model, cfg.model_dir)
        return model, from_pretrained(cfg.model_dir)
    ckpt = load_checkpoint(cfg.ckpt_path)
    if ckpt.tokenizer_json is None:
        raise ConfigError(
            f"checkpoint {cfg.ckpt_path} has no tokenizer (written before tokenizers were stored)"
        )
    model = ckpt.spec.model(ckpt.config)
    load_state_into(model, ckpt.state_dict, source=f"checkpoint {cfg.ckpt_path}")
    return model, Tokenizer.from_str(ckpt.tokenizer_json)


def generate_text(argv: list[str] | None = None) -> str:
    cfg = parse_cli(DEFAULTS, argv)
    model, tokenizer = load_model(cfg)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(device).eval()
    ids = special_ids(tokenizer)
    prompt = [ids.bot, *tokenizer.encode(cfg.prompt, add_special_tokens=False).ids]
    out = generate(
        model,
        torch.tensor([prompt], device=device),
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        eos_id=ids.eot,
        generator=torch.Generator(device=device).manual_seed(cfg.seed),
    )
    text = tokenizer.decode(out[0, 1:].tolist(), skip_special_tokens=True)
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    run_cli(generate_text, argv, usage(__doc__, DEFAULTS))


if __name__ == "__main__":
    main()
