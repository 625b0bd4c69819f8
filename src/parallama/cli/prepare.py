"""`parallama-prepare` (or `python -m parallama.cli.prepare`): the tokenizer and the token cache, built ahead of training.

A Hydra app over the training config (conf/prepare.yaml composes conf/train.yaml), so the overrides of a training
run name the same cache entry, which that run then reuses:

    parallama-prepare data/source=files data.source.paths='corpus/*.jsonl' tokenizer=bpe
    parallama-train   data/source=files data.source.paths='corpus/*.jsonl' tokenizer=bpe strategy=ddp ...

Tokenizing runs in `prepare.num_proc` processes, keeps finished parts across a kill (a rerun continues), and can be
spread over nodes (`prepare.num_nodes`, `prepare.node_rank`); see `parallama.data.cache` and docs/data.md.
Neither torch nor Lightning is imported.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import hydra
from omegaconf import DictConfig

from parallama.app.parts import check_parts
from parallama.cli import app
from parallama.config.schema import train_rules
from parallama.data.cache import STEPS, TokenCache, load_tokenizer, source_key
from parallama.data.sources import interleave, mixture_key, mixture_sources, named
from parallama.errors import ConfigError
from parallama.rules import Rule, check_keys, check_values, key

log = logging.getLogger("parallama")


@dataclass
class Prepare:
    """The tool's own keys (`prepare.*`; the rest is the training config), their defaults and valid values
    (rules.py `key`)."""

    conf: ClassVar[str] = "prepare.yaml:prepare"

    num_proc: int | None = key(None, Rule(int, 1, allow=(None,)))
    num_nodes: int = key(1, Rule(int, 1))
    node_rank: int = key(0, Rule(int, 0))
    step: str = key("all", Rule(str, choices=("tokenizer", *STEPS)))
    part_chars: int = key(4000000, Rule(int, 1))
    shard_tokens: int = key(100000000, Rule(int, 1))


def check(cfg: DictConfig, hardware: bool = True) -> None:
    """The values `prepare` uses, each in one line naming the key (nothing else of the training config matters)."""
    check_values(cfg, train_rules("seed", "data."))
    check_parts(cfg)  # the data source's and the tokenizer's keys, by the parts' own rules
    check_keys(cfg, Prepare, "prepare")
    p = cfg.prepare
    if p.node_rank >= p.num_nodes:
        raise ConfigError(
            f"prepare.node_rank={p.node_rank} is not below prepare.num_nodes={p.num_nodes}; "
            f"use 0..{p.num_nodes - 1}"
        )


def cores() -> int:
    """The cores this process may run on (a SLURM or container CPU limit), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare(cfg: DictConfig) -> list:
    """Build (or find) the entry, or every source's entry of a mixture (`data.sources`, one tokenizer for all);
    returns them, without those a node leaves to node 0's index step. The command line's values were checked
    before (`check`)."""

    data, p = cfg.data, cfg.prepare
    source = hydra.utils.instantiate(data.get("source"))
    mixture = mixture_sources(source, hydra.utils.instantiate(data.get("sources")))
    if mixture:  # as the data module: the tokenizer reads every source, each source has its own entry
        stream, key = partial(interleave, mixture), mixture_key(mixture)
        sources = {name: source for name, (_, source) in sorted(mixture.items())}
    else:
        stream, key, sources = source, source_key(source), {"": source}  # finds missing paths before any work
    tokenizer = load_tokenizer(stream, hydra.utils.instantiate(data.tokenizer), data.cache_dir, key)
    if p.step == "tokenizer":
        return []
    num_proc = p.num_proc or cores()
    where = f" on node {p.node_rank} of {p.num_nodes}" if p.num_nodes > 1 else ""
    note = "" if p.step == "index" else f" with {num_proc} process{'es' if num_proc > 1 else ''}{where}"
    entries = []
    for name, source in sources.items():
        with named(name) if name else nullcontext():
            cache = TokenCache(
                source, tokenizer, data.cache_dir, data.val_fraction, data.seed, source_key(source)
            )
            entry = cache.build_or_open(
                num_proc=num_proc,
                num_nodes=p.num_nodes,
                node_rank=p.node_rank,
                step=p.step,
                part_chars=p.part_chars,
                shard_tokens=p.shard_tokens,
                batch_size=data.get("tokenize_batch_size", 1000),
                note=note,
            )
        label = f"{name}: " if name else ""
        if entry is not None:
            log.info(f"{label}token cache ready: {entry.path}: {entry.summary()}")
            entries.append(entry)
        elif p.step == "parts":
            log.info(f"{label}node {p.node_rank}: parts done; write the index with prepare.step=index")
        else:
            log.info(
                f"{label}node {p.node_rank}: parts done; node 0 writes the index once every node's parts exist"
            )
    return entries


def main(argv: list[str] | None = None) -> None:
    app.run("prepare", prepare, argv, check=check, log_errors=True)


if __name__ == "__main__":
    main()
