"""LightningDataModule: documents -> tokenizer -> cached token memmaps -> batches.

Cache layout under `cache_dir` (all writes atomic, since several ranks or nodes may
build the same entry at once; identical inputs give identical files; modes follow the
umask, e.g. 0644/0755, so that a team can share one cache):

    tokenizer-<hash>.json    trained BPE tokenizers (hash: source + tokenizer config)
    <hash>/                  one tokenized corpus (hash: source + the tokenizer's own
        train.bin, val.bin     JSON + val_fraction + seed); flat token ids, uint16/uint32
        train.idx.npy, ...     int64 document start offsets plus the final end
        meta.json              n_docs, n_tokens per split, dtype, vocab_size
        tokenizer.json         the tokenizer that produced the ids

"source" is its config plus its `fingerprint` (see `sources`): path, size and mtime_ns of
each local file, the Python build for the embedded corpora; a Hub dataset has its config
only, so delete its entry when the dataset changes. Editing a local file in place makes a
new entry. `seq_len`, `packing` and batch settings only affect loading, so they share an entry.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from functools import cached_property

import numpy as np
import torch
from lightning import LightningDataModule
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from parallama.data.datasets import PackedDataset, PaddedDataset, ResumableDistributedSampler
from parallama.data.progress import Progress
from parallama.data.tokenizer import CHUNK_CHARS, SpecialIds, chunks, special_ids, splits_safely
from parallama.errors import ConfigError

SPLITS = ("train", "val")
BATCH_CHARS = 256 * 1024  # text per encode_batch call: bounds the tokenizer's Encoding objects

log = logging.getLogger("parallama")


def _spec(fn: Callable) -> str:
    """Stable description of a (partial) callable; `repr(partial)` holds an address."""
    func = getattr(fn, "func", fn)
    args, kwargs = getattr(fn, "args", ()), getattr(fn, "keywords", {})
    return f"{func.__module__}.{func.__qualname__}{tuple(args)!r}{sorted(kwargs.items())!r}"


def _source_key(source: Callable) -> list:
    """The source's config and what its documents depend on beyond it (its `fingerprint`, if any)."""
    func = getattr(source, "func", source)
    fingerprint = getattr(func, "fingerprint", None)
    args, kwargs = getattr(source, "args", ()), getattr(source, "keywords", {})
    return [_spec(source), fingerprint(*args, **kwargs) if fingerprint else None]


def _hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _tmp_path(parent: str, prefix: str) -> str:
    """A fresh name to write to and then rename. Created with open()/mkdir, so the umask sets its mode
    (tempfile.mkstemp/mkdtemp would force 0600/0700 and make a shared cache unreadable)."""
    return os.path.join(parent, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _open_tokens(path: str, dtype: str) -> np.ndarray:
    # np.memmap refuses empty files (e.g. val.bin when val_fraction is 0)
    return np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)


def _pieces(docs: Iterable[str], size: int | None) -> Iterator[tuple[str, bool, bool]]:
    """(text, first piece of its document, last piece) for every document, cut in `chunks` of `size`."""
    for doc in docs:
        parts = chunks(doc, size) if size else iter((doc,))
        part, first = next(parts), True
        for after in parts:
            yield part, first, False
            part, first = after, False
        yield part, first, True


class TextDataModule(LightningDataModule):
    """Pretraining data. `batch_size` is per process: global batch = batch_size x world size.

    `source` and `tokenizer` are callables (Hydra `_partial_: true`); a tokenizer that
    takes `texts` (e.g. `train_bpe`) is trained on all source documents.
    """

    def __init__(
        self,
        source: Callable[[], Iterable[str]],
        tokenizer: Callable[..., Tokenizer],
        seq_len: int = 256,
        batch_size: int = 16,
        packing: bool = True,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        cache_dir: str = "data/cache",
        seed: int = 42,
        tokenize_batch_size: int = 1000,
    ):
        super().__init__()
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len} must be >= 1")
        if batch_size < 1:
            raise ConfigError(f"data.batch_size={batch_size} must be >= 1")
        if not 0 <= val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction} must be in [0, 1)")
        self.source, self.tokenizer_fn = source, tokenizer
        self.seq_len, self.batch_size, self.packing = seq_len, batch_size, packing
        self.val_fraction, self.num_workers, self.seed = val_fraction, num_workers, seed
        self.cache_dir, self.tokenize_batch_size = cache_dir, tokenize_batch_size
        self._trains = "texts" in inspect.signature(tokenizer).parameters
        self._source_key = _source_key(source)  # also finds missing or unreadable paths before any work
        self._resume_state: dict | None = None
        self.datasets: dict[str, Dataset] = {}

    @cached_property
    def tokenizer(self) -> Tokenizer:
        if not self._trains:
            return self.tokenizer_fn()
        path = os.path.join(
            self.cache_dir, f"tokenizer-{_hash(self._source_key, _spec(self.tokenizer_fn))}.json"
        )
        if os.path.exists(path):
            log.info(f"reusing tokenizer {path}")
            return Tokenizer.from_file(path)
        log.info(f"training tokenizer {path}")
        with Progress("training tokenizer", unit="chars") as progress:
            tok = self.tokenizer_fn(texts=progress.counted(self.source()))
        os.makedirs(self.cache_dir, exist_ok=True)
        tmp = _tmp_path(self.cache_dir, ".tokenizer-")
        try:
            tok.save(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return tok

    @cached_property
    def data_dir(self) -> str:
        """The token cache entry: keyed on the tokenizer itself, so an edited tokenizer file gets a new one."""
        tok = hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()
        return os.path.join(self.cache_dir, _hash(self._source_key, tok, self.val_fraction, self.seed))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def special_ids(self) -> SpecialIds:
        return special_ids(self.tokenizer)

    def prepare_data(self) -> None:
        """Tokenize every document to [BOT] + ids + [EOT] and split by document."""
        if os.path.isdir(self.data_dir):
            meta = self._meta()
            log.info(
                f"reusing token cache {self.data_dir}: {sum(meta['n_docs'].values()):,} docs, "
                f"{sum(meta['n_tokens'].values()):,} tokens"
            )
            return
        log.info(f"building token cache {self.data_dir}")
        os.makedirs(self.cache_dir, exist_ok=True)
        tmp = _tmp_path(self.cache_dir, f".{os.path.basename(self.data_dir)}-")
        os.mkdir(tmp)
        try:
            self._build(tmp)
            os.rename(tmp, self.data_dir)
        except OSError:
            if not os.path.isdir(self.data_dir):  # not a lost race with another builder
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _meta(self) -> dict:
        with open(os.path.join(self.data_dir, "meta.json")) as f:
            return json.load(f)

    def _build(self, out: str) -> None:
        tok = self.tokenizer
        dtype = np.dtype(np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32)
        all_path = os.path.join(out, "all.bin")
        with open(all_path, "wb") as f, Progress("tokenizing") as progress:
            lengths = self._tokenize(self.source(), f, dtype, progress)
        n_docs = len(lengths)
        if n_docs == 0:
            raise ConfigError("data.source yielded no documents")
        n_val = max(1, round(self.val_fraction * n_docs)) if self.val_fraction > 0 and n_docs >= 2 else 0
        n_val = min(n_val, n_docs - 1)
        perm = np.random.default_rng(self.seed).permutation(n_docs)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        tokens = _open_tokens(all_path, dtype.name)
        meta = {"n_docs": {}, "n_tokens": {}, "dtype": dtype.name, "vocab_size": tok.get_vocab_size()}
        for split, docs_idx in (("train", perm[n_val:]), ("val", perm[:n_val])):
            docs_idx = np.sort(docs_idx)  # keep source order within a split
            with open(os.path.join(out, f"{split}.bin"), "wb") as f:
                for d in docs_idx:
                    f.write(tokens[offsets[d] : offsets[d + 1]].tobytes())
            split_offsets = np.concatenate([[0], np.cumsum(offsets[docs_idx + 1] - offsets[docs_idx])])
            np.save(os.path.join(out, f"{split}.idx.npy"), split_offsets.astype(np.int64))
            meta["n_docs"][split], meta["n_tokens"][split] = len(docs_idx), int(split_offsets[-1])
        del tokens
        os.remove(all_path)
        tok.save(os.path.join(out, "tokenizer.json"))
        with open(os.path.join(out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)

    def _tokenize(self, docs: Iterable[str], f, dtype: np.dtype, progress: Progress) -> list[int]:
        """Write [BOT] + ids + [EOT] of every document to `f`; returns their lengths. Memory does not grow
        with the longest document: long ones are encoded in chunks where that keeps the ids the same
        (`splits_safely`), at most BATCH_CHARS of text per encode_batch, ids go out as numpy arrays."""
        tok, ids = self.tokenizer, self.special_ids
        bot, eot = np.array([ids.bot], dtype), np.array([ids.eot], dtype)
        size = CHUNK_CHARS if splits_safely(tok) else None
        lengths: list[int] = []
        doc_len = 0  # tokens so far of the document in progress (it may span batches)
        batch: list[tuple[str, bool, bool]] = []
        chars = 0

        def flush() -> None:
            nonlocal doc_len
            arrays, n_tokens, n_docs = [], 0, 0
            for (_, first, last), enc in zip(
                batch, tok.encode_batch([text for text, _, _ in batch], add_special_tokens=False), strict=True
            ):
                arrays += [bot] * first + [encoded := np.array(enc.ids, dtype)] + [eot] * last
                n = len(encoded) + first + last
                doc_len, n_tokens = doc_len + n, n_tokens + n
                if last:
                    lengths.append(doc_len)
                    doc_len, n_docs = 0, n_docs + 1
            f.write(np.concatenate(arrays).tobytes())
            progress.update(n_docs, n_tokens)
            batch.clear()

        for piece in _pieces(docs, size):
            batch.append(piece)
            chars += len(piece[0])
            if len(batch) >= self.tokenize_batch_size or chars >= BATCH_CHARS:
                flush()
                chars = 0
        if batch:
            flush()
        return lengths

    def setup(self, stage: str | None = None) -> None:
        """Open the cached splits; builds the cache when used outside a Trainer. For `fit`, checks that
        the train split holds one step for every rank (else the run would end having trained nothing)."""
        if self.datasets:
            return
        if not os.path.isdir(self.data_dir):
            self.prepare_data()
        meta = self._meta()
        for split in SPLITS:
            path = os.path.join(self.data_dir, split)
            tokens = _open_tokens(f"{path}.bin", meta["dtype"])
            if self.packing:
                self.datasets[split] = PackedDataset(tokens, self.seq_len)
            else:
                offsets = np.load(f"{path}.idx.npy")
                self.datasets[split] = PaddedDataset(tokens, offsets, self.seq_len, self.special_ids.pad)
        world = self._world()[0]
        need = self.batch_size * world if stage == "fit" else 1
        if (have := len(self.datasets["train"])) < need:
            step = (
                f"one step needs data.batch_size * world size = {need}"
                if stage == "fit"
                else "at least 1 is needed"
            )
            raise ConfigError(
                f"data: the train split has {have} samples of seq_len {self.seq_len} "
                f"({meta['n_tokens']['train']} tokens) but {step}; "
                "use more data or lower data.batch_size/data.seq_len"
            )

    def _world(self) -> tuple[int, int]:
        return (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)

    def _loader(self, split: str, sampler: DistributedSampler, drop_last: bool) -> DataLoader:
        return DataLoader(
            self.datasets[split],
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
            drop_last=drop_last,
        )

    def train_dataloader(self) -> DataLoader:
        world, rank = self._world()
        sampler = ResumableDistributedSampler(
            self.datasets["train"], world, rank, shuffle=True, seed=self.seed
        )
        if self._resume_state:
            sampler.load_state_dict(self._resume_state)  # skip what was trained on before the checkpoint
            self._resume_state = None
        return self._loader("train", sampler, drop_last=True)

    def state_dict(self) -> dict:
        """Where training stands inside the epoch, saved in every checkpoint for an exact mid-epoch resume.

        Counts the batches the loop has trained on, not what the sampler has handed out: loaders prefetch.
        """
        if self.trainer is None:
            return {}
        batches = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        position = {"epoch": self.trainer.current_epoch, "consumed": batches * self.batch_size}
        return {**position, **self._order(self.trainer.world_size)}

    def load_state_dict(self, state: dict) -> None:
        self._resume_state = state or None

    def _order(self, world_size: int) -> dict:
        """What fixes the order of training samples: resuming under other values would skip or repeat some."""
        return {
            "seed": self.seed,
            "data.seq_len": self.seq_len,
            "data.batch_size": self.batch_size,
            "data.packing": self.packing,
            "data.val_fraction": self.val_fraction,
            "world size (trainer.devices x trainer.num_nodes)": world_size,
            "token cache": os.path.basename(self.data_dir),
        }

    def check_resume(self, saved: dict, world_size: int, source: str) -> None:
        """One line naming the first setting that differs from the checkpoint's (checkpoints that predate a key
        are not checked for it)."""
        for key, value in self._order(world_size).items():
            if key in saved and saved[key] != value:
                what = "data (source, files or tokenizer)" if key == "token cache" else key
                raise ConfigError(
                    f"{source} was trained with {key}={saved[key]} but this run has {value}: resuming would "
                    f"skip or repeat training samples; resume with the checkpoint's {what}"
                )

    def val_dataloader(self) -> DataLoader:
        """Sequential shards per rank; DistributedSampler pads the last one with repeats,
        so with several ranks a few val samples may count twice."""
        world, rank = self._world()
        sampler = DistributedSampler(self.datasets["val"], world, rank, shuffle=False, drop_last=False)
        return self._loader("val", sampler, drop_last=False)
