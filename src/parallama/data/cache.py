"""The token cache: each source tokenized once per tokenizer, as fixed-size shards plus one index.

Layout under `cache_dir` (all writes atomic: temp name + rename; identical inputs give identical files; modes
follow the umask, e.g. 0644/0755, so that a team can share one cache):

    tokenizer-<hash>.json        trained BPE tokenizers (hash: source + tokenizer config)
    <hash>/                      one entry: a source tokenized by one tokenizer (hash: source, the tokenizer's
        parts-<part_chars>/        own JSON, val_fraction, seed); while building only:
                                   the corpus in parts (see `parts`), kept across kills, removed at the end
        train-00000.bin, ...     the train split's tokens, [BOT] ids [EOT] per document, `shard_tokens` per
        val-00000.bin, ...         shard (the last shorter); uint16, or uint32 above 65536 tokens
        train.idx.npy, val.idx.npy int64 document offsets into the split (plus the end)
        tokenizer.json           the tokenizer that produced the ids
        index.json               shards, n_docs and n_tokens per split, dtype, vocab_size; written last, so an
                                 entry is complete iff its index.json exists

"source" is its config plus its `fingerprint` (see `sources`): path, size and mtime_ns of each local file, the
Python build for the embedded corpora; a Hub dataset has its config only. `TokenCache(...).build_or_open()` is
the one way in, for training (in its process) and `parallama-prepare` (in parallel, on several nodes) alike;
num_proc, nodes, `part_chars` and `shard_tokens` are not part of the key (the tokens do not depend on them).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Iterable
from functools import cached_property

import numpy as np
from tokenizers import Tokenizer

from parallama.data.index import Finished, all_parts, save_atomic, upgrade_v1, write_index
from parallama.data.parts import build_parts, parts_dir
from parallama.data.progress import Progress
from parallama.data.shards import ShardedTokens
from parallama.errors import ConfigError

SHARD_TOKENS = 100_000_000  # 200 MB shards at uint16
# Characters per part: the work a kill can lose per process, the text in flight per worker.
PART_CHARS = 4_000_000
STEPS = ("all", "parts", "index")

log = logging.getLogger("parallama")


def _spec(fn: Callable) -> str:
    """Stable description of a (partial) callable; `repr(partial)` holds an address."""
    func = getattr(fn, "func", fn)
    args, kwargs = getattr(fn, "args", ()), getattr(fn, "keywords", {})
    return f"{func.__module__}.{func.__qualname__}{tuple(args)!r}{sorted(kwargs.items())!r}"


def _source_attr(source: Callable, name: str):
    """`source.<name>(same arguments)` for a source function that has it (`fingerprint`, `num_documents`)."""
    func = getattr(source, "func", source)
    attr = getattr(func, name, None)
    return attr(*getattr(source, "args", ()), **getattr(source, "keywords", {})) if attr else None


def source_key(source: Callable) -> list:
    """The source's config and what its documents depend on beyond it (its `fingerprint`, if any)."""
    return [_spec(source), _source_attr(source, "fingerprint")]


def _hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def trains(tokenizer_fn: Callable) -> bool:
    """Whether the tokenizer factory learns from the corpus (takes `texts`, e.g. `train_bpe`)."""
    return "texts" in inspect.signature(tokenizer_fn).parameters


def load_tokenizer(
    source: Callable[[], Iterable[str]], tokenizer_fn: Callable, cache_dir: str, key: list | None = None
) -> Tokenizer:
    """The factory's tokenizer; one that trains is trained on `source` once and kept in `cache_dir`."""
    if not trains(tokenizer_fn):
        return tokenizer_fn()
    key = source_key(source) if key is None else key
    path = os.path.join(cache_dir, f"tokenizer-{_hash(key, _spec(tokenizer_fn))}.json")
    if os.path.exists(path):
        log.info(f"reusing tokenizer {path}")
        return Tokenizer.from_file(path)
    log.info(f"training tokenizer {path}")
    cap = getattr(tokenizer_fn, "keywords", {}).get("train_documents")  # train_bpe reads only the first ones
    known = [n for n in (_source_attr(source, "num_documents"), cap) if n is not None]
    with Progress("training tokenizer", unit="chars", total=min(known, default=None)) as progress:
        tok = tokenizer_fn(texts=progress.counted(source()))
    os.makedirs(cache_dir, exist_ok=True)
    save_atomic(path, lambda f: f.write(tok.to_str(pretty=True).encode()))
    return tok


class CacheEntry:
    """A complete entry, opened: its splits as token arrays and document offsets."""

    def __init__(self, path: str):
        self.path, self.name = path, os.path.basename(path)
        with open(os.path.join(path, "index.json")) as f:
            self.index = json.load(f)
        self.n_docs, self.n_tokens = self.index["n_docs"], self.index["n_tokens"]
        self.dtype, self.vocab_size = self.index["dtype"], self.index["vocab_size"]

    def tokens(self, split: str) -> ShardedTokens:
        shards = self.index["splits"][split]["shards"]
        paths = [os.path.join(self.path, s["file"]) for s in shards]
        return ShardedTokens(paths, self.dtype, [s["tokens"] for s in shards])

    def doc_offsets(self, split: str) -> np.ndarray:
        """int64 start of each document in `tokens(split)`, plus the end (memory-mapped)."""
        return np.load(os.path.join(self.path, self.index["splits"][split]["doc_offsets"]), mmap_mode="r")

    def summary(self) -> str:
        return f"{sum(self.n_docs.values()):,} docs, {sum(self.n_tokens.values()):,} tokens"


class TokenCache:
    """The cache entry of one source tokenized by one tokenizer: its name, building it, opening it."""

    def __init__(
        self,
        source: Callable[[], Iterable[str]],
        tokenizer: Tokenizer,
        cache_dir: str,
        val_fraction: float,
        seed: int,
        key: list | None = None,
    ):
        self.source, self.tokenizer, self.cache_dir = source, tokenizer, cache_dir
        self.val_fraction, self.seed = val_fraction, seed
        self.key = source_key(source) if key is None else key

    @cached_property
    def name(self) -> str:
        """Keyed on the tokenizer itself, so an edited tokenizer file gets a new entry."""
        tok = hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()
        return _hash(self.key, tok, self.val_fraction, self.seed)

    @property
    def path(self) -> str:
        return os.path.join(self.cache_dir, self.name)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.tokenizer.get_vocab_size() <= 2**16 else np.uint32)

    def open(self) -> CacheEntry | None:
        """The entry if it is complete (an entry of the older one-file layout is upgraded first), else None."""
        if not os.path.exists(os.path.join(self.path, "index.json")):
            if not os.path.exists(os.path.join(self.path, "meta.json")):
                return None
            try:
                upgrade_v1(self.path)
            except FileNotFoundError:  # meta.json removed by a racing upgrader, who wrote index.json first
                pass
        return CacheEntry(self.path)

    def build_or_open(
        self,
        *,
        num_proc: int = 1,
        num_nodes: int = 1,
        node_rank: int = 0,
        step: str = "all",
        part_chars: int = PART_CHARS,
        shard_tokens: int = SHARD_TOKENS,
        batch_size: int = 1000,
        note: str = "",
    ) -> CacheEntry | None:
        """The entry, built first if it does not exist. Step `all`: this node's parts, then (node 0) the index,
        once every node's parts exist; `parts`: only this node's parts; `index`: only the index. Returns None
        where this call leaves the index to another (nodes > 0, step `parts`)."""
        if (entry := self.open()) is not None:
            log.info(f"reusing token cache {self.path}: {entry.summary()}")
            return entry
        log.info(f"building token cache {self.path}{note}")
        folder = parts_dir(self.path, part_chars)
        try:
            if step != "index":
                self._parts(folder, num_proc, num_nodes, node_rank, part_chars, batch_size)
            if step == "parts" or (step == "all" and node_rank != 0):
                return None
            wait = step == "all" and num_nodes > 1  # the other nodes may still be at work
            lengths = all_parts(folder, self.dtype, num_nodes, wait, lambda: self.open() is not None)
            write_index(
                self.path,
                folder,
                lengths,
                self.tokenizer,
                self.dtype,
                self.val_fraction,
                self.seed,
                shard_tokens,
            )
            return CacheEntry(self.path)
        except (FileNotFoundError, Finished):
            if (entry := self.open()) is not None:  # another builder finished the entry and removed the parts
                return entry
            raise
        finally:
            for empty in (folder, self.path):  # a build that failed before its first part leaves nothing
                try:
                    os.rmdir(empty)
                except OSError:
                    pass

    def _parts(
        self, folder: str, num_proc: int, num_nodes: int, node_rank: int, part_chars: int, batch_size: int
    ) -> None:
        total = _source_attr(self.source, "num_documents")
        share = -(-total // num_nodes) if total else None
        with Progress("tokenizing", total=share) as progress:
            info = build_parts(
                self.source(),
                self.tokenizer,
                folder,
                self.dtype,
                progress,
                part_chars=part_chars,
                num_proc=num_proc,
                num_nodes=num_nodes,
                node_rank=node_rank,
                batch_size=batch_size,
            )
        if info["n_docs"] == 0:
            raise ConfigError("data.source yielded no documents")
