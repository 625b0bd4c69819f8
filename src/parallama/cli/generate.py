"""`parallama-generate (ckpt_path=<checkpoint> | model_dir=<exported HF folder>) prompt="..." [max_new_tokens=N]
[temperature=T] [top_k=K] [top_p=P] [seed=S]`: sample a continuation (KV cache, stops at end of text).
temperature=0 is greedy, hence deterministic. A Hydra app (conf/generate.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import DictConfig

from parallama.cli import app
from parallama.errors import ConfigError
from parallama.rules import Rule, check_keys, key


@dataclass
class Generate:
    """The tool's keys, their defaults and valid values (rules.py `key`)."""

    conf: ClassVar[str] = "generate.yaml"

    ckpt_path: str | None = key(None)
    model_dir: str | None = key(None)
    prompt: str = key("The ", Rule(str))
    max_new_tokens: int = key(100, Rule(int, 0))
    temperature: float = key(0.8, Rule(float, 0))
    top_k: int | None = key(40, Rule(int, 1, allow=(None,)))
    top_p: float | None = key(None, Rule(float, 0, 1, open="low", allow=(None,)))
    seed: int = key(42, Rule(int, 0))
    device: str | None = key(None)


def check(cfg: DictConfig, hardware: bool = True) -> None:
    check_keys(cfg, Generate)
    if (cfg.ckpt_path is None) == (cfg.model_dir is None):
        raise ConfigError("give exactly one of ckpt_path=<checkpoint> or model_dir=<Hugging Face folder>")


def generate_text(cfg: DictConfig | list[str]) -> str:
    """The continuation, also printed; `cfg` may be the tool's command line (a list of overrides)."""
    import torch  # torch-free module

    from parallama.checkpoint.read import load_model  # torch-free module
    from parallama.models.generation import generate  # torch-free module
    from parallama.tokenizer import special_ids  # start-up time (tokenizers)

    if isinstance(cfg, list):
        cfg = app.compose("generate", cfg, check, list_keys=True)
    model, tokenizer = load_model(cfg.ckpt_path, cfg.model_dir)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(device).eval()
    ids = special_ids(tokenizer)
    prompt = [ids.bot, *tokenizer.encode(cfg.prompt, add_special_tokens=False).ids]
    try:
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
    except ValueError as err:  # e.g. a prompt + max_new_tokens longer than the model's context
        raise ConfigError(str(err)) from None
    text = tokenizer.decode(out[0, 1:].tolist(), skip_special_tokens=True)
    print(text)
    return text


def main(argv: list[str] | None = None) -> None:
    app.run("generate", generate_text, argv, check=check, list_keys=True)


if __name__ == "__main__":
    main()
