"""Phase 1 of building a token cache: the corpus as parts, tokenized in parallel and kept across restarts.

The source's document stream is cut into units of consecutive documents, each closed once it holds at least
`part_chars` characters, so the cut depends on the documents alone (never on the number of processes or
nodes). Unit `u` belongs to node `u % num_nodes`; this process reads the stream and hands its node's units to
`num_proc` worker processes (or tokenizes them itself when num_proc is 1). Unit `u` becomes part `u`:

    parts-<part_chars>/
        part-000042.bin        its documents' tokens, [BOT] ids [EOT] each (the entry's dtype)
        part-000042.docs.npy   int64 token count of each document, written last
        units.json             {"n_units", "n_docs"} of the whole stream, written by a node that has read it all

A part is finished iff its `.docs.npy` loads and the `.bin` holds exactly the tokens it counts; a restart
skips finished parts and redoes the others (a truncated or corrupt one is redone with a warning).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait

import numpy as np
from tokenizers import Tokenizer

from parallama.data.shards import tmp_name, write_json
from parallama.tokenizer import encode_documents

log = logging.getLogger("parallama")


def parts_dir(entry: str, part_chars: int) -> str:
    """Parts of another `part_chars` hold other documents, so they live in their own folder."""
    return os.path.join(entry, f"parts-{part_chars}")


def part_paths(folder: str, unit: int) -> tuple[str, str]:
    base = os.path.join(folder, f"part-{unit:06d}")
    return f"{base}.bin", f"{base}.docs.npy"


def units(docs: Iterable[str], part_chars: int) -> Iterator[list[str]]:
    """Consecutive documents, cut after the one that brings a unit to `part_chars` characters."""
    unit, chars = [], 0
    for doc in docs:
        unit.append(doc)
        chars += len(doc)
        if chars >= part_chars:
            yield unit
            unit, chars = [], 0
    if unit:
        yield unit


def part_lengths(folder: str, unit: int, dtype: np.dtype) -> np.ndarray | None:
    """The document lengths of part `unit` if it is finished, else None (logging why a present part is not)."""
    bin_path, docs_path = part_paths(folder, unit)
    if not os.path.exists(docs_path):
        return None
    try:
        lengths = np.load(docs_path)
        expected = int(lengths.sum()) * np.dtype(dtype).itemsize
        size = os.path.getsize(bin_path)
    except (OSError, ValueError, EOFError) as err:  # a truncated .npy, or the .bin gone
        log.warning(f"part {docs_path} is unreadable ({type(err).__name__}: {err}); tokenizing it again")
        return None
    if size != expected:
        log.warning(
            f"part {bin_path} has {size} bytes but its documents need {expected}; tokenizing it again"
        )
        return None
    return lengths


def encode_part(
    tok: Tokenizer, docs: list[str], folder: str, unit: int, dtype: np.dtype, progress, batch_size: int
) -> int:
    """Tokenize `docs` into part `unit` (temp names, then renamed: the `.docs.npy` last). Returns its tokens."""
    bin_path, docs_path = part_paths(folder, unit)
    tmp = tmp_name(folder, ".part-")
    try:
        with open(tmp, "wb") as f:
            lengths = np.array(encode_documents(tok, docs, f, dtype, progress, batch_size), dtype=np.int64)
        os.replace(tmp, bin_path)
        with open(tmp, "wb") as f:
            np.save(f, lengths)
        os.replace(tmp, docs_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return int(lengths.sum())


# --- worker processes ----------------------------------------------------------------------------------------

_worker: dict = {}  # the tokenizer and settings of this worker process, set once by _start_worker


class _QueueProgress:
    """A worker's progress: (docs, tokens) after every encode batch, to the parent's live line."""

    def __init__(self, queue):
        self.queue = queue

    def update(self, docs: int, count: int) -> None:
        self.queue.put((docs, count))


def _start_worker(tokenizer_json: str, dtype: str, batch_size: int, queue, parent: int) -> None:
    # One process per core: the tokenizer's own thread pool would only compete with the other workers.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = Tokenizer.from_str(tokenizer_json)
    _worker.update(tok=tok, dtype=np.dtype(dtype), batch_size=batch_size, progress=_QueueProgress(queue))
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    """A parent killed with SIGKILL cannot stop its workers: they notice it is gone and exit."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def _encode_in_worker(docs: list[str], folder: str, unit: int) -> int:
    w = _worker
    return encode_part(w["tok"], docs, folder, unit, w["dtype"], w["progress"], w["batch_size"])


# --- the pass over the stream ------------------------------------------------------------------------------


def build_parts(
    docs: Iterable[str],
    tok: Tokenizer,
    folder: str,
    dtype: np.dtype,
    progress,
    *,
    part_chars: int,
    num_proc: int = 1,
    num_nodes: int = 1,
    node_rank: int = 0,
    batch_size: int = 1000,
) -> dict:
    """Tokenize this node's unfinished units of `docs` into `folder`; returns (and saves) {"n_units", "n_docs"}."""
    os.makedirs(folder, exist_ok=True)
    n_units = n_docs = reused = 0
    pool: _Pool | None = None
    held: tuple[list[str], int] | None = None  # the first unit to do, kept until a second shows a pool pays
    try:
        for unit, block in enumerate(units(docs, part_chars)):
            n_units, n_docs = unit + 1, n_docs + len(block)
            if unit % num_nodes != node_rank:
                continue
            if part_lengths(folder, unit, dtype) is not None:
                reused += 1
                progress.reused(len(block))
            elif num_proc == 1:
                encode_part(tok, block, folder, unit, dtype, progress, batch_size)
            elif held is None and pool is None:
                held = (block, unit)
            else:
                if pool is None:
                    pool = _Pool(tok, dtype, progress, num_proc, batch_size)
                    pool.submit(held[0], folder, held[1])
                pool.submit(block, folder, unit)
        if pool is not None:
            pool.finish()
        elif held is not None:  # a single unit: no processes to start
            encode_part(tok, held[0], folder, held[1], dtype, progress, batch_size)
    finally:
        if pool is not None:
            pool.close()
    units_info = {"n_units": n_units, "n_docs": n_docs}
    if n_docs:
        write_json(os.path.join(folder, "units.json"), units_info)
    reuse = f"{reused} of them done by an earlier run and reused"
    if num_nodes == 1:
        log.info(f"{n_units} parts ({reuse})")
    else:
        log.info(
            f"{n_units} parts, {len(range(node_rank, n_units, num_nodes))} of node {node_rank} ({reuse})"
        )
    return units_info


class _Pool:
    """`num_proc` spawned workers; at most one unit waits per worker, so memory does not grow with the corpus."""

    def __init__(self, tok: Tokenizer, dtype: np.dtype, progress, num_proc: int, batch_size: int):
        ctx = multiprocessing.get_context("spawn")  # no fork: the parent's tokenizer threads would deadlock
        self.queue, self.progress, self.limit = ctx.SimpleQueue(), progress, 2 * num_proc
        self.executor = ProcessPoolExecutor(
            num_proc,
            mp_context=ctx,
            initializer=_start_worker,
            initargs=(tok.to_str(), np.dtype(dtype).str, batch_size, self.queue, os.getpid()),
        )
        self.pending: set[Future] = set()

    def submit(self, block: list[str], folder: str, unit: int) -> None:
        while len(self.pending) >= self.limit:
            self._wait()
        self.pending.add(self.executor.submit(_encode_in_worker, block, folder, unit))

    def _wait(self) -> None:
        """Until a unit is done (or 0.2 s passed, to show the workers' progress)."""
        done, self.pending = wait(self.pending, timeout=0.2, return_when=FIRST_COMPLETED)
        self._drain()
        for future in done:
            future.result()  # a worker's exception, raised here

    def _drain(self) -> None:
        while not self.queue.empty():
            self.progress.update(*self.queue.get())

    def finish(self) -> None:
        while self.pending:
            self._wait()
        self._drain()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
