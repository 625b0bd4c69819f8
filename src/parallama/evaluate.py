"""`parallama-eval ckpt_path=<checkpoint> [split=val|train] [batch_size=N] [max_batches=N] [json=true] [data.*=...]`:
loss and perplexity of a checkpoint of any strategy, in one process.

The data is the run's own: `data.*` from the resolved_config.yaml next to `checkpoints/` (else the default
embedded corpus), overridable key by key (`data.source=files data.source.paths=...` switches the source),
tokenized by the tokenizer stored in the checkpoint. Same seed and val_fraction -> same held-out documents.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from parallama.checkpoint import load_checkpoint, load_state_into, parse_cli, run_cli, run_config
from parallama.errors import ConfigError
from parallama.model import Llama

DATA_CONF = Path(__file__).resolve().parents[2] / "conf" / "data"
DEFAULTS = {
    "ckpt_path": None,
    "split": "val",
    "batch_size": None,
    "max_batches": None,
    "json": False,
    "device": None,
}


def default_data() -> DictConfig:
    """conf/data/default.yaml with its embedded source, for checkpoints without their run folder."""
    data = OmegaConf.load(DATA_CONF / "default.yaml")
    data.pop("defaults")
    data.merge_with({"source": OmegaConf.load(DATA_CONF / "source/embedded.yaml"), "cache_dir": "data/cache"})
    data.merge_with(
        {"seed": 42, "tokenizer": {"_target_": "parallama.data.tokenizer.byte_level", "_partial_": True}}
    )
    return data


def data_config(ckpt_path: str, source: str | None) -> DictConfig:
    """The run's data config; `source` (from `data.source=<name>`) swaps in conf/data/source/<name>.yaml."""
    run = run_config(ckpt_path)
    data = run.data if run is not None else default_data()
    if source is not None:
        file = DATA_CONF / "source" / f"{source}.yaml"
        if not file.is_file():
            names = sorted(p.stem for p in file.parent.glob("*.yaml"))
            raise ConfigError(f"data.source={source} is not a source; valid: {', '.join(names)}")
        data.source = OmegaConf.load(file)
    return data


def evaluate(argv: list[str] | None = None) -> dict:
    args = sys.argv[1:] if argv is None else argv
    top = parse_cli(DEFAULTS, [a for a in args if not a.startswith("data.")], required=("ckpt_path",))
    sources = [a.removeprefix("data.source=") for a in args if a.startswith("data.source=")]
    data = data_config(top.ckpt_path, sources[-1] if sources else None)
    cfg = parse_cli({**DEFAULTS, "data": data}, [a for a in args if not a.startswith("data.source=")])
    data = cfg.data
    if cfg.split not in ("val", "train"):
        raise ConfigError(f"split={cfg.split} is not valid; use val or train")
    ckpt = load_checkpoint(cfg.ckpt_path)
    if cfg.batch_size is not None:
        data.batch_size = cfg.batch_size
    if ckpt.tokenizer_json is not None:  # a stable file name keeps the tokenized-corpus cache key stable
        digest = hashlib.sha256(ckpt.tokenizer_json.encode()).hexdigest()[:16]
        tok_file = Path(data.cache_dir, f"tokenizer-ckpt-{digest}.json")
        tok_file.parent.mkdir(parents=True, exist_ok=True)
        tok_file.write_text(ckpt.tokenizer_json)
        data.tokenizer = {"_target_": "parallama.data.tokenizer.from_pretrained", "_partial_": True}
        data.tokenizer.name_or_path = str(tok_file)
    datamodule = hydra.utils.instantiate(data)
    datamodule.setup()
    loader = datamodule.val_dataloader() if cfg.split == "val" else datamodule.train_dataloader()

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = Llama(ckpt.config)
    load_state_into(model, ckpt.state_dict, source=f"checkpoint {cfg.ckpt_path}")
    model.to(device).eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for i, batch in enumerate(loader):
            if cfg.max_batches is not None and i >= cfg.max_batches:
                break
            mask = batch.get("attention_mask")
            logits = model(batch["input_ids"].to(device), None if mask is None else mask.to(device))
            labels = batch["labels"].to(device)
            total += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum").item()
            count += int((labels != -100).sum())
    if count == 0:
        raise ConfigError(
            f"split={cfg.split} has no tokens to evaluate (raise data.val_fraction or max_batches)"
        )
    loss = total / count
    result = {"loss": loss, "ppl": math.exp(loss), "tokens": count, "split": cfg.split}
    if cfg.json:
        print(json.dumps(result))
    else:
        print(f"loss={loss:.4f} ppl={math.exp(loss):.3f} tokens={count}")
    return result


def main(argv: list[str] | None = None) -> None:
    run_cli(evaluate, argv)


if __name__ == "__main__":
    main()
