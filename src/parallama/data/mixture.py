"""Weighted mixtures of several document sources (`data.sources`, docs/data.md "Mixtures").

The config side (`data.sources`, the tokenizer's document stream, the cache key) is in `sources`, which
`parallama-prepare` reads without torch. Each source keeps its own token cache entry and dataset; `MixtureDataset` presents them as one map-style dataset
with a fixed number of items per epoch, each source holding its weight's share of them. The train sampler permutes
it like any dataset, so the data position, the trained-sample hash and the resume checks apply unchanged.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from torch.utils.data import Dataset

from parallama.data.datasets import ResumableDistributedSampler, epoch_order
from parallama.errors import ConfigError


def shares(weights: np.ndarray, n: int) -> np.ndarray:
    """Whole numbers of items in proportion to `weights` that add up to `n`: each weight's exact share rounded
    down or up, the remainder going to the largest fractions (Hamilton's method; ties: the first)."""
    exact = weights / weights.sum() * n
    counts = np.floor(exact).astype(np.int64)
    left = n - int(counts.sum())
    counts[np.argsort(counts - exact, kind="stable")[:left]] += 1
    return counts


class MixtureDataset(Dataset):
    """Several datasets as one of N items per epoch, N being the sum of their lengths; source s (sorted by name)
    owns items [o_s, o_s + n_s), n_s being its weight's share of N (`shares`).

    Each source is read as an endless stream of passes, each pass a fresh permutation of its samples seeded with
    (`seed`, its name, the pass). Epoch e takes the source's stream positions [e n_s, (e+1) n_s), handed out in
    the order the epoch's train order (`epoch_order` with the sampler's `seed`) reaches the source's items. So a
    source smaller than its share repeats, every sample once per pass, passes one after the other in training
    order; a larger one is subsampled, each epoch continuing where the last stopped, so all its samples are used
    before any repeats. Memory: one int64 per item for the current epoch, built at its first item.

    Keys are `(epoch, index)` from `EpochIndexSampler`, or a bare index (read as epoch 0: overfit_batches and
    other samplers). Items are the source's item with `index` = the mixture index.
    """

    def __init__(self, datasets: Mapping[str, Dataset], weights: Mapping[str, float], seed: int):
        self.names = sorted(datasets)  # the layout does not depend on the order of the config's entries
        self.datasets = [datasets[name] for name in self.names]
        self.lengths = np.array([len(d) for d in self.datasets], dtype=np.int64)
        for name, length in zip(self.names, self.lengths, strict=True):
            if length == 0:
                raise ConfigError(f"data.sources.{name} has no train samples to mix")
        self.counts = shares(
            np.array([weights[name] for name in self.names], dtype=np.float64), int(self.lengths.sum())
        )
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.seed = seed
        self._table: tuple[int, np.ndarray] | None = None  # (epoch, each item's sample in its source)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_ids(self, indices: np.ndarray) -> np.ndarray:
        """Position in `names` of the source each mixture index belongs to."""
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def locate(self, epoch: int, index: int) -> tuple[str, int]:
        """(source name, sample index in that source) of mixture item `index` in `epoch`."""
        return self.names[int(self.source_ids(index))], int(self._samples(epoch)[index])

    def __getitem__(self, key: tuple[int, int] | int) -> dict[str, torch.Tensor]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(index)
        item = dict(self.datasets[int(self.source_ids(index))][int(self._samples(epoch)[index])])
        item["index"] = torch.tensor(index)
        return item

    def _samples(self, epoch: int) -> np.ndarray:
        if self._table is None or self._table[0] != epoch:
            self._table = None  # free the last epoch's table first
            order = epoch_order(len(self), self.seed, epoch)
            in_order = self.source_ids(order)
            samples = np.empty(len(self), dtype=np.int64)
            for s, n in enumerate(self.counts.tolist()):
                samples[order[in_order == s]] = self._stream(s, epoch * n, n)
            self._table = (epoch, samples)
        return self._table[1]

    def _stream(self, s: int, start: int, n: int) -> np.ndarray:
        """Samples at positions [start, start + n) of source s's stream of passes."""
        length = int(self.lengths[s])
        first, end = start // length, -(-(start + n) // length)
        passes = [self._pass(s, p) for p in range(first, end)] or [np.empty(0, dtype=np.int64)]
        return np.concatenate(passes)[start - first * length :][:n]

    def _pass(self, s: int, p: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, zlib.crc32(self.names[s].encode()), p])
        return rng.permutation(int(self.lengths[s]))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_table": None}  # DataLoader workers build their own


class EpochIndexSampler(ResumableDistributedSampler):
    """The train sampler, each index paired with its epoch: a mixture's items depend on the epoch, and DataLoader
    workers hold their own copy of the dataset (persistent ones never see `set_epoch`)."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch  # the epoch the sampler's order is of (set_epoch or start_at set it)
        return ((epoch, i) for i in super().__iter__())
