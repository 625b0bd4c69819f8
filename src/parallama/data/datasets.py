"""Map-style datasets over a flat token array, and the train sampler.

Token arrays are usually read-only `np.memmap`s of the cache; they pickle as their
path, not their data, so DataLoader workers (fork or spawn) each map the file.
Every item carries its sample `index`: the data module checks each train batch against
the data order and drops the key before the batch moves to the device.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from parallama.tokenizer import IGNORE_INDEX, SpecialIds


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
    token is an input exactly once and documents are separated only by BOT/EOT.

    With `document_specials` (the tokenizer's ids) items are ready for document masking: they also carry
    `position_ids` (restarting at 0 with every document, and at the window's start for the document the
    window cuts into) and `document_ids` (0, 1, ... within the window), and the label that would predict
    the next document's BOT from the last token of a document is IGNORE_INDEX. That target is always BOT and
    says nothing about either document; a padded sample (PaddedDataset) never trains it either, so each
    document's loss terms are exactly those of the document alone (as Megatron-LM's `eod_mask_loss`).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, document_specials: SpecialIds | None = None):
        self.tokens, self.seq_len, self.document_specials = tokens, seq_len, document_specials

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start, end = i * self.seq_len, (i + 1) * self.seq_len + 1
        if self.document_specials is None:
            x = torch.from_numpy(self.tokens[start:end].astype(np.int64))
            return {"input_ids": x[:-1], "labels": x[1:], "index": torch.tensor(i)}
        before = 1 if start else 0  # one token of look-back tells whether the window starts a document
        read = self.tokens[start - before : end].astype(np.int64)
        x, n = read[before:], self.seq_len
        starts = document_starts(read, self.document_specials) - before  # in x, 0 is of no concern
        starts = starts[starts > 0]
        labels = x[1:].copy()
        labels[starts - 1] = IGNORE_INDEX
        inner = starts[starts < n]  # an input token begins a document
        document_ids = np.zeros(n, dtype=np.int64)
        document_ids[inner] = 1
        document_ids = document_ids.cumsum()
        position_ids = np.arange(n) - np.concatenate(([0], inner))[document_ids]
        return {
            "input_ids": torch.from_numpy(x[:-1]),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids),
            "document_ids": torch.from_numpy(document_ids),
            "index": torch.tensor(i),
        }


def document_starts(tokens: np.ndarray, specials: SpecialIds) -> np.ndarray:
    """Indices in `tokens` where a document begins: a BOT right after an EOT (so never index 0). Asking for the
    EOT too keeps tokenizers whose BOT and EOT are one token (GPT-2's <|endoftext|>) right, and a BOT spelled
    out inside a document's text does not count."""
    return np.flatnonzero((tokens[1:] == specials.bot) & (tokens[:-1] == specials.eot)) + 1


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
        return {"input_ids": x[:-1], "labels": labels, "attention_mask": mask, "index": torch.tensor(i)}


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The train order of `n` samples in `epoch`: a permutation seeded with seed + epoch (DistributedSampler's)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).numpy()


class ResumableDistributedSampler(DistributedSampler):
    """The train order: each epoch a permutation of the samples seeded with seed + epoch (DistributedSampler's),
    of which rank r of `num_replicas` reads positions r, r + world, r + 2 world, ...

    So global batch j (per-rank batch b) is positions [j*b*world, (j+1)*b*world) whatever the world size:
    1 process x batch 2b sees what 2 ranks x batch b see, and `start_at` can continue an epoch at a global
    position under another world size or batch size.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0):
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self._start: tuple[int, int] | None = None  # (epoch, global position) to start from once
        self._order: tuple[int, np.ndarray] | None = None  # the last epoch's order, for the position checks

    def order(self, epoch: int) -> np.ndarray:
        """Sample index at each global position of `epoch`."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(len(self.dataset), self.seed, epoch))
        return self._order[1]

    def start_at(self, epoch: int, position: int) -> None:
        """Begin the next iteration of `epoch` at global `position` (not if the loop has moved to a new epoch)."""
        self.epoch, self._start = epoch, (epoch, position)

    def __iter__(self) -> Iterator[int]:
        epoch, start = self._start or (self.epoch, 0)
        start, self._start = (start if epoch == self.epoch else 0), None
        order = self.order(self.epoch)
        per_rank = max(len(order) - start, 0) // self.num_replicas
        yield from order[start + self.rank :: self.num_replicas][:per_rank].tolist()
