"""Phase 2 of building a token cache: once every part exists, split by document into shards, then the index.

Runs once per entry (node 0). Memory: one part's tokens at a time, and a few tens of bytes per document
(lengths, the held-out mask and the permutation that draws it); never the corpus or a per-token array.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable

import numpy as np
from tokenizers import Tokenizer

from parallama.data.parts import part_lengths, part_paths
from parallama.data.shards import ShardWriter, tmp_name, write_json
from parallama.errors import ConfigError

SPLITS = ("train", "val")
FORMAT = 2  # 1 (before parallama-prepare): train.bin, val.bin, meta.json; 2: shards + index.json

log = logging.getLogger("parallama")


class Finished(Exception):
    """Another builder completed the entry meanwhile (and removed the parts this one was reading)."""


def split_documents(n_docs: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which documents are held out (a bool per document): a seeded permutation's first n_val, at least one
    when val_fraction > 0 and there are two documents, never all of them."""
    n_val = max(1, round(val_fraction * n_docs)) if val_fraction > 0 and n_docs >= 2 else 0
    n_val = min(n_val, n_docs - 1)
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return is_val


def all_parts(
    folder: str, dtype: np.dtype, num_nodes: int, wait: bool, finished: Callable[[], bool]
) -> list[np.ndarray]:
    """The document lengths of every part. Missing parts are waited for (`wait`: node 0 of step `all`, while
    the other nodes work), else one error names them and the nodes that make them."""
    units_path, waited = os.path.join(folder, "units.json"), 0
    while True:
        if finished():
            raise Finished
        n_units, missing = None, []
        if os.path.exists(units_path):
            with open(units_path) as f:
                n_units = json.load(f)["n_units"]
            lengths = [part_lengths(folder, u, dtype) for u in range(n_units)]
            missing = [u for u, part in enumerate(lengths) if part is None]
            if not missing:
                return lengths
        nodes = sorted({u % num_nodes for u in missing}) if n_units else list(range(num_nodes))
        if not wait:
            if n_units is None:
                raise ConfigError(
                    f"prepare.step=index: no node has finished its parts yet ({units_path} is missing); "
                    "run prepare.step=parts (or all) on every node first"
                )
            raise ConfigError(
                f"prepare.step=index: {len(missing)} of {n_units} parts are missing (part-{missing[0]:06d} "
                f"first, in {folder}); run prepare.node_rank={','.join(map(str, nodes))} "
                f"(of prepare.num_nodes={num_nodes}) to make them"
            )
        if waited % 60 == 0:
            log.info(f"waiting for the parts of nodes {nodes} of prepare.num_nodes={num_nodes} ({waited} s)")
        time.sleep(5)
        waited += 5


def write_index(
    entry: str,
    folder: str,
    lengths: list[np.ndarray],
    tokenizer: Tokenizer,
    dtype: np.dtype,
    val_fraction: float,
    seed: int,
    shard_tokens: int,
) -> None:
    """Copy every part, in order, into the train and val shards (a document goes whole to one split, source
    order kept within each), save the document offsets and the tokenizer, write index.json last, then remove
    the parts."""
    is_val = split_documents(sum(map(len, lengths)), val_fraction, seed)
    writers = {split: ShardWriter(entry, split, dtype, shard_tokens) for split in SPLITS}
    split_lengths: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    first = 0  # index of the part's first document in the corpus
    try:
        for unit, part in enumerate(lengths):
            tokens = np.fromfile(part_paths(folder, unit)[0], dtype=dtype)
            ends = np.cumsum(part)
            val = is_val[first : first + len(part)]
            for split, mask in (("train", ~val), ("val", val)):
                docs = np.flatnonzero(mask)
                runs = np.split(docs, np.flatnonzero(np.diff(docs) != 1) + 1) if len(docs) else []
                for run in runs:  # consecutive documents: one copy
                    writers[split].write(tokens[ends[run[0]] - part[run[0]] : ends[run[-1]]])
                split_lengths[split].append(part[docs])
            first += len(part)
        shards = {split: writers[split].close() for split in SPLITS}
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    index = {"format": FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": tokenizer.get_vocab_size()}
    index.update(shard_tokens=shard_tokens, n_docs={}, n_tokens={}, splits={})
    for split in SPLITS:
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(split_lengths[split]))]).astype(np.int64)
        save_atomic(os.path.join(entry, f"{split}.idx.npy"), lambda f, offsets=offsets: np.save(f, offsets))
        sizes = [shard_tokens] * len(shards[split])
        if sizes:
            sizes[-1] = int(offsets[-1]) - shard_tokens * (len(sizes) - 1)
        index["n_docs"][split], index["n_tokens"][split] = len(offsets) - 1, int(offsets[-1])
        index["splits"][split] = {
            "shards": [{"file": name, "tokens": n} for name, n in zip(shards[split], sizes)],
            "doc_offsets": f"{split}.idx.npy",
        }
    save_atomic(
        os.path.join(entry, "tokenizer.json"), lambda f: f.write(tokenizer.to_str(pretty=True).encode())
    )
    write_json(os.path.join(entry, "index.json"), index)
    for name in os.listdir(entry):  # this build's parts, and those of other part_chars
        if name.startswith("parts-"):
            gone = tmp_name(os.path.dirname(entry), ".removing-")
            os.rename(os.path.join(entry, name), gone)
            shutil.rmtree(gone, ignore_errors=True)


def upgrade_v1(entry: str) -> None:
    """An entry of the one-file layout (train.bin, val.bin, meta.json) becomes a layout-2 entry in place: each
    file is renamed to its split's single shard, the index written from meta.json. Same tokens, so same name:
    runs keep reusing (and resuming on) it without tokenizing again. Racing upgraders end with the same files."""
    with open(os.path.join(entry, "meta.json")) as f:
        meta = json.load(f)
    index = {"format": FORMAT, "dtype": meta["dtype"], "vocab_size": meta["vocab_size"]}
    index.update(
        shard_tokens=max(meta["n_tokens"].values()), n_docs=meta["n_docs"], n_tokens=meta["n_tokens"]
    )
    index["splits"] = {}
    for split in SPLITS:
        shard, n = f"{split}-00000.bin", meta["n_tokens"][split]
        try:
            os.replace(os.path.join(entry, f"{split}.bin"), os.path.join(entry, shard))
        except FileNotFoundError:  # renamed by another upgrader
            pass
        if n == 0 and os.path.exists(os.path.join(entry, shard)):
            os.remove(os.path.join(entry, shard))
        shards = [{"file": shard, "tokens": n}] if n else []
        index["splits"][split] = {"shards": shards, "doc_offsets": f"{split}.idx.npy"}
    write_json(os.path.join(entry, "index.json"), index)
    if os.path.exists(meta_path := os.path.join(entry, "meta.json")):
        os.remove(meta_path)
    log.info(f"token cache {entry}: upgraded in place to layout {FORMAT} (shards + index.json)")


def save_atomic(path: str, write: Callable) -> None:
    """`write(binary file)` to a temporary name beside `path`, then rename it to `path`."""
    tmp = tmp_name(os.path.dirname(path), f".{os.path.basename(path)}-")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
