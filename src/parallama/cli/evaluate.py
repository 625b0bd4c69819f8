"""`parallama-eval ckpt_path=<checkpoint> [split=val|train] [max_batches=N] [json=true] [device=...] [data.*=...]`:
loss and perplexity of a checkpoint of any strategy, in one process. A Hydra app (conf/eval.yaml).

The data is the run's own: plain values of `data.*` in the resolved_config.yaml next to `checkpoints/` (else
conf/data), with the command line's data overrides on top (`data/source=files data.source.paths=...`
switches the source), tokenized by the tokenizer stored in the checkpoint. Same seed and val_fraction ->
same held-out documents. That file travels with the checkpoint, so only parallama's own data classes are
instantiated from it.
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

from parallama import CONF_DIR
from parallama.checkpoint.read import load_checkpoint, load_state_into, run_config, run_config_path
from parallama.errors import ConfigError

DATA_CONF = CONF_DIR / "data"
TOP_KEYS = "ckpt_path, split, max_batches, json, device, seed, data.*"
TARGETS = {  # what parallama-eval instantiates: the data module, its sources and tokenizers
    f"parallama.data.{name}"
    for name in ("TextDataModule", "sources.embedded", "sources.files", "sources.hub")
    + ("tokenizer.byte_level", "tokenizer.train_bpe", "tokenizer.from_pretrained")
}


def check_targets(node, where: str, key: str = "data") -> None:
    """Refuse any `_target_` that is not one of parallama's data classes (Hydra would import and call it)."""
    if isinstance(node, dict):
        target = node.get("_target_")
        if target is not None and target not in TARGETS:
            raise ConfigError(
                f"{where} has {key}._target_={target}, which parallama-eval does not instantiate; "
                f"allowed: {', '.join(sorted(TARGETS))}"
            )
        for k, v in node.items():
            check_targets(v, where, f"{key}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            check_targets(v, where, f"{key}.{i}")


def data_config(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The run's data with the command line's `data.*` / `data/...` overrides (their composed values) on top."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    run = run_config(cfg.ckpt_path)
    if run is None or "data" not in run:
        return cfg.data
    check_targets(OmegaConf.to_container(run.data), str(run_config_path(cfg.ckpt_path)))
    data = run.data
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group.replace("/", ".")
        if key == "data":
            data = cfg.data
        elif key.startswith("data."):
            sub = key.removeprefix("data.")
            if override.is_delete():
                parent, _, leaf = sub.rpartition(".")
                (OmegaConf.select(data, parent) if parent else data).pop(leaf, None)
            else:
                OmegaConf.update(data, sub, OmegaConf.select(cfg, key), merge=False)
    return data


def evaluate(cfg: DictConfig, overrides: list[str] = ()) -> dict:
    """`overrides`: the command line's, so that the `data.*` ones apply on top of the run's own data."""
    if cfg.split not in ("val", "train"):
        raise ConfigError(f"split={cfg.split} is not valid; use val or train")
    data = data_config(cfg, overrides)
    ckpt = load_checkpoint(cfg.ckpt_path)
    if ckpt.tokenizer_json is not None:  # a stable file name keeps the tokenized-corpus cache key stable
        digest = hashlib.sha256(ckpt.tokenizer_json.encode()).hexdigest()[:16]
        tok_file = Path(data.cache_dir, f"tokenizer-ckpt-{digest}.json")
        tok_file.parent.mkdir(parents=True, exist_ok=True)
        tok_file.write_text(ckpt.tokenizer_json)
        data.tokenizer = {"_target_": "parallama.data.tokenizer.from_pretrained", "_partial_": True}
        data.tokenizer.name_or_path = str(tok_file)
    data = OmegaConf.to_container(data, resolve=True)
    check_targets(data, "the data config")
    datamodule = hydra.utils.instantiate(data)
    datamodule.setup()
    loader = datamodule.val_dataloader() if cfg.split == "val" else datamodule.train_dataloader()

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = ckpt.spec.model(ckpt.config)
    load_state_into(model, ckpt.state_dict, source=f"checkpoint {cfg.ckpt_path}")
    model.to(device).eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for i, batch in enumerate(loader):
            if cfg.max_batches is not None and i >= cfg.max_batches:
                break
            inputs = {k: v.to(device) for k, v in batch.items() if k not in ("labels", "index")}
            logits = model(**inputs)  # input_ids, and attention_mask or position_ids + document_ids
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


def source_alias(argv: list[str]) -> list[str]:
    """`data.source=<name>` (the older spelling) means the config group choice `data/source=<name>`."""
    args = []
    for arg in argv:
        if arg.startswith("data.source="):
            name = arg.removeprefix("data.source=")
            if not (DATA_CONF / "source" / f"{name}.yaml").is_file():
                names = sorted(p.stem for p in (DATA_CONF / "source").glob("*.yaml"))
                raise ConfigError(f"{arg} is not a source; valid: {', '.join(names)}")
            arg = f"data/source={name}"
        args.append(arg)
    return args


def preflight(argv: list[str]) -> None:
    """Compose as Hydra will, so that a typo is one line (Hydra's own flags such as --help are left to it)."""
    from hydra import initialize_config_dir

    from parallama.config.compose import compose_job

    if any(arg.startswith("-") for arg in argv):
        return
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose_job("eval", argv, valid_keys=TOP_KEYS)
    if missing := sorted(OmegaConf.missing_keys(cfg)):
        raise ConfigError(f"{missing[0]}= is required: add {missing[0]}=<value>")


@hydra.main(config_path=str(CONF_DIR), config_name="eval", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> dict:
    from hydra.core.hydra_config import HydraConfig

    try:
        return evaluate(cfg, list(HydraConfig.get().overrides.task))
    except (ValueError, FileNotFoundError) as err:  # ConfigError and the model's own checks
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """The console script; `argv` (instead of sys.argv) lets tests run it in-process."""
    try:
        args = source_alias(sys.argv[1:] if argv is None else argv)
        preflight(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    saved, sys.argv = sys.argv, [sys.argv[0], *args]
    try:
        _hydra_main()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
