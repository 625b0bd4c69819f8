"""LightningDataModule: documents -> tokenizer -> token cache (see `cache`) -> batches.

`prepare_data` builds a missing cache entry in this process with the same code as `parallama-prepare`
(resumable: a killed build continues where it stopped), so training on a corpus nobody prepared still works;
`seq_len`, `packing`, `document_mask` and batch settings only affect loading, so they share an entry.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Callable, Iterable, Mapping
from functools import cached_property, partial

import torch
from lightning import LightningDataModule
from tokenizers import Tokenizer
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler

from parallama.config.schema import Data, check_arguments
from parallama.data.cache import CacheEntry, TokenCache, load_tokenizer
from parallama.data.cache import source_key as _source_key
from parallama.data.datasets import PackedDataset, PaddedDataset, ResumableDistributedSampler
from parallama.data.index import SPLITS
from parallama.data.mixture import EpochIndexSampler, MixtureDataset
from parallama.data.position import TrainPosition, saved_position
from parallama.data.sources import interleave, mixture_key, mixture_sources, named
from parallama.errors import ConfigError
from parallama.tokenizer import SpecialIds, byte_level, special_ids

# What each source of a mixture shares with the mixture's data module (`parts`)
PART_SETTINGS = (
    *("seq_len", "batch_size", "packing", "document_mask", "val_fraction"),
    *("num_workers", "cache_dir", "seed", "tokenize_batch_size"),
)
log = logging.getLogger("parallama")
# Overrides that can change the cache entry, for the `parallama-prepare` command suggested when training builds it
_ENTRY_KEYS = (
    "data/",
    "data.source",
    "data.val_fraction",
    "data.cache_dir",
    "tokenizer",
    "paths",
    "seed",
    "experiment",
)


def _prepare_hint() -> str:
    """The `parallama-prepare` command that builds this run's entry ahead: its own overrides, under Hydra."""
    from hydra.core.hydra_config import HydraConfig  # start-up time (hydra)

    try:
        overrides = HydraConfig.get().overrides.task
    except ValueError:  # not run by Hydra
        args = "<the same data/tokenizer overrides>"
    else:
        args = " ".join(shlex.quote(o) for o in overrides if o.lstrip("+~").startswith(_ENTRY_KEYS))
    return (
        " in this process; for big corpora build it ahead, in parallel and resumable: "
        f"parallama-prepare {args}".rstrip()
    )


class TextDataModule(LightningDataModule):
    """Pretraining data. `batch_size` is per process: global batch = batch_size x data-parallel size.

    `source` and `tokenizer` are callables (Hydra `_partial_: true`); a tokenizer that
    takes `texts` (e.g. `train_bpe`) is trained on the source's documents (see `cache.load_tokenizer`).
    `sources` instead of `source`: a weighted mixture, {name: {weight, source}} (see `mixture`).
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
        check_arguments("data", Data, seq_len=seq_len, batch_size=batch_size, val_fraction=val_fraction)
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
        # also finds missing or unreadable paths before any work
        self._source_key = mixture_key(self.mixture) if self.mixture else _source_key(source)
        if self.mixture:  # what a trained tokenizer reads; the token cache has an entry per source (`parts`)
            self.source = partial(interleave, self.mixture)
        self._resume_state: dict | None = None
        self.position: TrainPosition | None = None  # set with the train loader
        self._logged_position: tuple[int, int] | None = None
        self.datasets: dict[str, Dataset] = {}

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.source, self.tokenizer_fn, self.cache_dir, self._source_key)

    @cached_property
    def cache(self) -> TokenCache:
        return TokenCache(
            self.source, self.tokenizer, self.cache_dir, self.val_fraction, self.seed, self._source_key
        )

    @property
    def data_dir(self) -> str:
        """The token cache entry: keyed on the tokenizer itself, so an edited tokenizer file gets a new one."""
        return self.cache.path

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def special_ids(self) -> SpecialIds:
        return special_ids(self.tokenizer)

    def prepare_data(self) -> None:
        """Tokenize every document to [BOT] + ids + [EOT] and split by document, unless the entry exists."""
        if self.mixture:
            return self._prepare_mixture()
        self._entry()

    def _entry(self) -> CacheEntry:
        """Built in this process (the tokenizer's own threads use the cores); `parallama-prepare` builds the same
        entry with several processes or nodes. Ranks that did not build it find it complete."""
        return self.cache.build_or_open(batch_size=self.tokenize_batch_size, note=_prepare_hint())

    def _meta(self) -> dict:
        return CacheEntry(self.data_dir).index

    def setup(self, stage: str | None = None) -> None:
        """Open the cached splits (once: a validation before training opens them for the fit after it); builds
        the cache when used outside a Trainer. For `fit`, checks that the train split holds one step for every
        rank (else the run would end having trained nothing)."""
        if not self.datasets:
            if self.mixture:
                self._setup_mixture()
            else:
                self._open_splits()
        self._check_train_split(stage)
        self._check_val_split(stage)

    def _open_splits(self) -> None:
        entry = self.cache.open() or self._entry()
        for split in SPLITS:
            tokens = entry.tokens(split)
            if self.packing:
                specials = self.special_ids if self.document_mask else None
                self.datasets[split] = PackedDataset(tokens, self.seq_len, specials)
            else:
                offsets = entry.doc_offsets(split)
                self.datasets[split] = PaddedDataset(tokens, offsets, self.seq_len, self.special_ids.pad)

    def _check_train_split(self, stage: str | None) -> None:
        need = self.batch_size * self._world()[0] if stage == "fit" else 1
        if (have := len(self.datasets["train"])) >= need:
            return
        step = (
            f"one step needs data.batch_size * world size = {need}"
            if stage == "fit"
            else "at least 1 is needed"
        )
        if self.mixture:
            raise ConfigError(
                f"data.sources: the mixture has {have} train samples of seq_len {self.seq_len} but {step}; use more "
                "data or lower data.batch_size"
            )
        raise ConfigError(
            f"data: the train split has {have} samples of seq_len {self.seq_len} "
            f"({self._meta()['n_tokens']['train']} tokens) but {step}; "
            "use more data or lower data.batch_size/data.seq_len"
        )

    def _check_val_split(self, stage: str | None) -> None:
        """A run that validates needs a validation sample (found: one 50 MB document trained with `final metrics:
        {}` and only Lightning's generic warning): documents are held out whole, so one document, or held-out ones
        shorter than a sample, leave none. Checked as the data is set up, before training."""
        trainer = self.trainer
        validates = self.val_fraction > 0 and (trainer is None or trainer.limit_val_batches != 0)
        if stage not in ("fit", "validate") or not validates or len(self.datasets["val"]) > 0:
            return
        if self.mixture:
            held_out = "none of the mixture's sources holds out a sample"
        else:
            docs, tokens = self._meta()["n_docs"], self._meta()["n_tokens"]["val"]
            held_out = (
                f"{docs['val']} of {docs['train'] + docs['val']} documents held out, {tokens} tokens, fewer than "
                f"a sample of data.seq_len={self.seq_len}"
            )
        raise ConfigError(
            f"data: the validation split is empty ({held_out}; documents are held out whole, data.val_fraction="
            f"{self.val_fraction} of them): use more documents (split a long one into several), raise "
            "data.val_fraction, or train without validation with data.val_fraction=0"
        )

    def _world(self) -> tuple[int, int]:
        """The data-parallel size and this process's rank in it: what the strategy tells Lightning's samplers
        (`distributed_sampler_kwargs`: parallama's strategies count the data-parallel ranks of their mesh, whose
        tensor-parallel ranks share their data); one process without a trainer or with a single-device strategy.
        Every use (sampler, position, checks) reads them here."""
        shard = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        return (shard["num_replicas"], shard["rank"]) if shard else (1, 0)

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
        where = (state["epoch"], state["global_consumed"])
        if self._world()[1] == 0 and where != self._logged_position:  # once, not per checkpoint of a step
            self._logged_position = where
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
            **(self._mixture_order() if self.mixture else {"token cache": self.cache.name}),
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

    def _setup_mixture(self) -> None:
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
        if self._world()[1] == 0:
            log.info(
                f"data mixture of {len(train):,} samples per epoch: "
                + ", ".join(
                    f"{name} {weights[name] / total:.3g} = {n:,} of {length:,} ({n / length:.2f} passes)"
                    for name, n, length in zip(train.names, train.counts, train.lengths, strict=True)
                )
            )

    def _mixture_order(self) -> dict:
        """The weights (as configured) and every source's token cache entry fix a mixture's order."""
        return {
            "data.sources": {name: weight for name, (weight, _) in sorted(self.mixture.items())},
            "token cache": ", ".join(
                f"{name}={part.cache.name}" for name, part in sorted(self.parts.items())
            ),
        }
