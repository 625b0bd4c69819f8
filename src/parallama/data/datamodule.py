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
new entry. `seq_len`, `packing`, `document_mask` and batch settings only affect loading, so they share an entry.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from functools import cached_property, partial

import numpy as np
import torch
from lightning import LightningDataModule
from tokenizers import Tokenizer
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler

from parallama.data.datasets import PackedDataset, PaddedDataset, ResumableDistributedSampler
from parallama.data.mixture import EpochIndexSampler, MixtureDataset, interleave, mixture_sources, named
from parallama.data.position import TrainPosition, saved_position
from parallama.data.progress import Progress
from parallama.data.tokenizer import SpecialIds, byte_level, encode_documents, special_ids
from parallama.errors import ConfigError

SPLITS = ("train", "val")
# What each source of a mixture shares with the mixture's data module (`parts`)
PART_SETTINGS = (
    *("seq_len", "batch_size", "packing", "document_mask", "val_fraction"),
    *("num_workers", "cache_dir", "seed", "tokenize_batch_size"),
)

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


class TextDataModule(LightningDataModule):
    """Pretraining data. `batch_size` is per process: global batch = batch_size x data-parallel size.

    `source` and `tokenizer` are callables (Hydra `_partial_: true`); a tokenizer that
    takes `texts` (e.g. `train_bpe`) is trained on all source documents. `sources` instead of `source`:
    a weighted mixture, {name: {weight, source}} (see `mixture`).
    """

    def __init__(
        self,
        source: Callable[[], Iterable[str]] | None = None,
        tokenizer: Callable[..., Tokenizer] = byte_level,
        seq_len: int = 256,
        batch_size: int = 16,
        packing: bool = True,
        document_mask: bool = False,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        cache_dir: str = "data/cache",
        seed: int = 42,
        tokenize_batch_size: int = 1000,
        index_log: str | None = None,
        sources: Mapping | None = None,
    ):
        super().__init__()
        if seq_len < 1:
            raise ConfigError(f"data.seq_len={seq_len} must be >= 1")
        if batch_size < 1:
            raise ConfigError(f"data.batch_size={batch_size} must be >= 1")
        if not 0 <= val_fraction < 1:
            raise ConfigError(f"data.val_fraction={val_fraction} must be in [0, 1)")
        if document_mask and not packing:
            raise ConfigError(
                "data.document_mask=true needs data.packing=true: a padded sample holds one document already"
            )
        self.mixture = mixture_sources(source, sources)  # None: the single `source`
        self.source, self.tokenizer_fn = source, tokenizer
        self.seq_len, self.batch_size, self.packing = seq_len, batch_size, packing
        self.document_mask = document_mask  # packed items carry position_ids and document_ids (datasets.py)
        self.val_fraction, self.num_workers, self.seed = val_fraction, num_workers, seed
        self.cache_dir, self.tokenize_batch_size = cache_dir, tokenize_batch_size
        self.index_log = index_log  # rank 0 appends each trained global batch's sample indices (JSON lines)
        self._trains = "texts" in inspect.signature(tokenizer).parameters
        # also finds missing or unreadable paths before any work
        self._source_key = self._mixture_key() if self.mixture else _source_key(source)
        if self.mixture:  # what a trained tokenizer reads; the token cache has an entry per source (`parts`)
            self.source = partial(interleave, self.mixture)
        self._resume_state: dict | None = None
        self.position: TrainPosition | None = None  # set with the train loader
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
        if self.mixture:
            return self._prepare_mixture()
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
            lengths = encode_documents(tok, self.source(), f, dtype, progress, self.tokenize_batch_size)
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

    def setup(self, stage: str | None = None) -> None:
        """Open the cached splits; builds the cache when used outside a Trainer. For `fit`, checks that
        the train split holds one step for every rank (else the run would end having trained nothing)."""
        if self.datasets:
            return
        if self.mixture:
            return self._setup_mixture(stage)
        if not os.path.isdir(self.data_dir):
            self.prepare_data()
        meta = self._meta()
        for split in SPLITS:
            path = os.path.join(self.data_dir, split)
            tokens = _open_tokens(f"{path}.bin", meta["dtype"])
            if self.packing:
                specials = self.special_ids if self.document_mask else None
                self.datasets[split] = PackedDataset(tokens, self.seq_len, specials)
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
        """The data-parallel size and this process's rank in it, from the strategy's device mesh (tensor-parallel
        ranks share their data): every use (sampler, position, checks) reads them here."""
        from parallama.parallel import data_parallel

        return data_parallel(self.trainer)

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
        sampler_type = EpochIndexSampler if self.mixture else ResumableDistributedSampler
        sampler = sampler_type(self.datasets["train"], world, rank, seed=self.seed)
        self.position = TrainPosition(sampler, self.batch_size, self.index_log if rank == 0 else None)
        if self._resume_state:  # continue at the checkpoint's global sample
            self.position.restore(self._resume_state, self.trainer, source="the checkpoint")
            self._resume_state = None
        return self._loader("train", sampler, drop_last=True)

    def on_before_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        """Check a train batch against the data order on the host (no device sync); no batch goes to the
        device with its `index`."""
        index = batch.pop("index")
        trainer = self.trainer
        # overfit_batches: Lightning swaps in a sequential sampler, so the data order does not apply.
        if (
            trainer is not None
            and trainer.training
            and self.position is not None
            and not trainer.overfit_batches
        ):
            self.position.received(index, trainer)
        return batch

    def state_dict(self) -> dict:
        """Saved in every checkpoint: the epoch and the global samples trained in it (an exact resume at any
        data-parallel size or batch size), what fixes the data order, and the running hash of trained samples."""
        if self.trainer is None or self.position is None:
            return {}
        state = {**self.position.state(self.trainer), **self._order()}
        if self._world()[1] == 0:
            log.info(
                f"data position: epoch {state['epoch']}, sample {state['global_consumed']:,}; "
                + self.position.summary()
            )
        return state

    def load_state_dict(self, state: dict) -> None:
        self._resume_state = state or None

    def teardown(self, stage: str) -> None:
        """At the end of fit: fold the last batch into the hash, and say what was trained."""
        if stage == "fit" and self.trainer is not None and self.position is not None:
            self.position.settle(self.trainer)
            if self._world()[1] == 0:
                log.info(f"data: {self.position.summary()}")

    def _order(self) -> dict:
        """What fixes the order of training samples: resuming under other values would skip or repeat some.
        The data-parallel size and batch size do not: the position is a global sample."""
        return {
            "seed": self.seed,
            "data.seq_len": self.seq_len,
            "data.packing": self.packing,
            "data.val_fraction": self.val_fraction,
            **(self._mixture_order() if self.mixture else {"token cache": os.path.basename(self.data_dir)}),
        }

    def check_resume(self, saved: dict, source: str) -> None:
        """One line naming the first setting that differs from the checkpoint's (checkpoints that predate a key
        are not checked for it), or a position that cannot be continued."""
        for key, value in self._order().items():
            if key in saved and saved[key] != value:
                what = "data (source, files or tokenizer)" if key == "token cache" else key
                raise ConfigError(
                    f"{source} was trained with {key}={saved[key]} but this run has {value}: resuming would "
                    f"skip or repeat training samples; resume with the checkpoint's {what}"
                )
        saved_position(saved, source)

    def val_dataloader(self) -> DataLoader:
        """Sequential shards per rank; DistributedSampler pads the last one with repeats,
        so with several ranks a few val samples may count twice."""
        world, rank = self._world()
        sampler = DistributedSampler(self.datasets["val"], world, rank, shuffle=False, drop_last=False)
        return self._loader("val", sampler, drop_last=False)

    # --- mixtures (data.sources) ---------------------------------------------------------------------------

    def _mixture_key(self) -> list:
        """What a tokenizer trained on the mixture depends on: every source's key and the weights."""
        keys = []
        for name, (weight, source) in sorted(self.mixture.items()):
            with named(name):
                keys.append([name, weight, _source_key(source)])
        return ["mixture", keys]

    @cached_property
    def parts(self) -> dict[str, TextDataModule]:
        """A single-source data module per mixture source, with this module's tokenizer: each builds and opens
        its own token cache entry, so adding a source or changing a weight re-tokenizes no other source (unless
        a trained tokenizer changes with them)."""
        tokenizer = partial(Tokenizer.from_str, self.tokenizer.to_str())
        settings = {key: getattr(self, key) for key in PART_SETTINGS}
        return {
            name: TextDataModule(source, tokenizer, **settings) for name, (_, source) in self.mixture.items()
        }

    def _prepare_mixture(self) -> None:
        for name, part in self.parts.items():
            with named(name):
                part.prepare_data()

    def _setup_mixture(self, stage: str | None) -> None:
        """The train split mixes the sources' train splits (`MixtureDataset`); val concatenates their val splits."""
        for name, part in self.parts.items():
            with named(name):
                part.setup()
        weights = {name: weight for name, (weight, _) in self.mixture.items()}
        total = sum(weights.values())
        train = MixtureDataset({n: p.datasets["train"] for n, p in self.parts.items()}, weights, self.seed)
        self.datasets = {
            "train": train,
            "val": ConcatDataset([p.datasets["val"] for p in self.parts.values()]),
        }
        world, rank = self._world()
        if rank == 0:
            log.info(
                f"data mixture of {len(train):,} samples per epoch: "
                + ", ".join(
                    f"{name} {weights[name] / total:.3g} = {n:,} of {length:,} ({n / length:.2f} passes)"
                    for name, n, length in zip(train.names, train.counts, train.lengths, strict=True)
                )
            )
        if stage == "fit" and len(train) < (need := self.batch_size * world):
            raise ConfigError(
                f"data.sources: the mixture has {len(train)} train samples of seq_len {self.seq_len} but one "
                f"step needs data.batch_size * world size = {need}; use more data or lower data.batch_size"
            )

    def _mixture_order(self) -> dict:
        """The weights (as configured) and every source's token cache entry fix a mixture's order."""
        return {
            "data.sources": {name: weight for name, (weight, _) in sorted(self.mixture.items())},
            "token cache": ", ".join(
                f"{name}={os.path.basename(part.data_dir)}" for name, part in sorted(self.parts.items())
            ),
        }
