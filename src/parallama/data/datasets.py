"""Map-style datasets over a flat token array, and the train sampler.

Token arrays are usually read-only `np.memmap`s of the cache; they pickle as their
path, not their data, so DataLoader workers (fork or spawn) each map the file.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

IGNORE_INDEX = -100  # label value skipped by torch.nn.functional.cross_entropy


class _TokenDataset(Dataset):
    tokens: np.ndarray

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if isinstance(self.tokens, np.memmap):
            state["tokens"] = (self.tokens.filename, self.tokens.dtype.str)
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["tokens"], tuple):
            filename, dtype = state["tokens"]
            state["tokens"] = np.memmap(filename, dtype=dtype, mode="r")
        self.__dict__.update(state)


class PackedDataset(_TokenDataset):
    """nanoGPT-style packing: item i is the window tokens[i*L : i*L + L + 1], so every
    token is an input exactly once and documents are separated only by BOT/EOT."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        x = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": x[:-1], "labels": x[1:]}


class PaddedDataset(_TokenDataset):
    """The source article's samples: one document each, truncated to seq_len + 1 tokens
    or right-padded with PAD; padded positions are masked out of loss and attention."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seq_len: int, pad_id: int):
        self.tokens, self.offsets, self.seq_len, self.pad_id = tokens, offsets, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        doc = self.tokens[start : min(end, start + self.seq_len + 1)]
        n = len(doc)
        x = torch.full((self.seq_len + 1,), self.pad_id, dtype=torch.int64)
        x[:n] = torch.from_numpy(doc.astype(np.int64))
        labels = x[1:].clone()
        labels[n - 1 :] = IGNORE_INDEX  # targets that are padding
        mask = (torch.arange(self.seq_len) < n).long()
        return {"input_ids": x[:-1], "labels": labels, "attention_mask": mask}


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can resume mid-epoch.

    Used even with one process, so that 1 process x batch 2b sees exactly what
    2 ranks x batch b see (rank r gets perm[r::world]). `state_dict` counts samples
    this rank has yielded in the current epoch; a loaded state skips them once.
    Note: DataLoader workers and Lightning prefetch ahead of training, so for an exact
    resume store the count of samples actually trained on (`{"epoch", "consumed"}`).
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.consumed = 0  # yielded so far this epoch
        self._skip: tuple[int, int] | None = None  # (epoch, samples) to skip once, after a load

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        skip_epoch, skip = self._skip or (None, 0)
        self.consumed, self._skip = (skip if skip_epoch == self.epoch else 0), None
        for i in indices[self.consumed :]:
            self.consumed += 1
            yield i

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skip `consumed` samples when `epoch` is iterated next (not if the loop has moved to a new epoch)."""
        self.epoch, self._skip = state["epoch"], (state["epoch"], state["consumed"])
