"""Token files: a split stored as fixed-size shards, written piece by piece and read as one array.

Builders write with plain file writes, never through a memmap (its pages would count in the builder's RSS and
grow with the corpus); readers (training) map each shard.
"""

from __future__ import annotations

import bisect
import json
import os
import uuid
from typing import BinaryIO

import numpy as np


def tmp_name(parent: str, prefix: str) -> str:
    """A fresh name to write to and then rename. Created with open()/mkdir, so the umask sets its mode
    (tempfile.mkstemp/mkdtemp would force 0600/0700 and make a shared cache unreadable)."""
    return os.path.join(parent, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}")


def write_json(path: str, obj: object) -> None:
    """Write `path` whole or not at all (temp name + rename)."""
    tmp = tmp_name(os.path.dirname(path), ".json-")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class ShardWriter:
    """Appends tokens to `<prefix>-00000.bin`, `<prefix>-00001.bin`, ... of `shard_tokens` tokens each (the
    last one shorter; none for no tokens). Each shard is written under a temporary name and renamed when full."""

    def __init__(self, folder: str, prefix: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.prefix, self.dtype, self.shard_tokens = (
            folder,
            prefix,
            np.dtype(dtype),
            shard_tokens,
        )
        self.shards: list[str] = []  # file names of the finished shards
        self._file: BinaryIO | None = None
        self._tmp, self._left = "", 0

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                self._tmp = tmp_name(self.folder, f".{self.prefix}-")
                self._file, self._left = open(self._tmp, "wb"), self.shard_tokens
            piece, tokens = tokens[: self._left], tokens[self._left :]
            self._file.write(piece.data)
            self._left -= len(piece)
            if self._left == 0:
                self._finish()

    def _finish(self) -> None:
        self._file.close()
        name = f"{self.prefix}-{len(self.shards):05d}.bin"
        os.replace(self._tmp, os.path.join(self.folder, name))
        self.shards.append(name)
        self._file = None

    def close(self) -> list[str]:
        if self._file is not None:
            self._finish()
        return self.shards

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            os.remove(self._tmp)


class ShardedTokens:
    """The shards of a split as one read-only token array: `len`, `[i]`, and `[a:b]` (a numpy array, also across
    shard boundaries). Pickles as its paths, so DataLoader workers (fork or spawn) map the files themselves."""

    def __init__(self, paths: list[str], dtype: str | np.dtype, sizes: list[int]):
        self.paths, self.dtype, self.sizes = list(paths), np.dtype(dtype), list(sizes)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).tolist()
        self._maps: list[np.memmap] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def _shards(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [np.memmap(p, dtype=self.dtype, mode="r") for p in self.paths]
        return self._maps

    def __getitem__(self, key: int | slice) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise ValueError("ShardedTokens slices take no step")
            return self._range(start, max(start, stop))
        i = key + len(self) if key < 0 else key
        if not 0 <= i < len(self):
            raise IndexError(key)
        s = bisect.bisect_right(self.starts, i) - 1
        return self._shards()[s][i - self.starts[s]]

    def _range(self, start: int, stop: int) -> np.ndarray:
        shards = self._shards()
        s = bisect.bisect_right(self.starts, start) - 1
        if start >= stop:
            return np.zeros(0, self.dtype)
        if stop <= self.starts[s + 1]:  # within one shard: a view
            return shards[s][start - self.starts[s] : stop - self.starts[s]]
        pieces = []
        while start < stop:
            end = min(stop, self.starts[s + 1])
            pieces.append(shards[s][start - self.starts[s] : end - self.starts[s]])
            start, s = end, s + 1
        return np.concatenate(pieces)

    def __getstate__(self) -> dict:
        return {"paths": self.paths, "dtype": self.dtype.str, "sizes": self.sizes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["paths"], state["dtype"], state["sizes"])
