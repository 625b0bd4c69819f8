"""Where training stands in the global data order, and a running hash of the samples it trained.

The position is a number of global samples, so that a run can continue at the same sample under another
data-parallel size or per-rank batch size. Lightning counts batches of *this* run's size
(`runtime.compat.batch_progress`); on resume its count is re-expressed in this run's batches.
"""

from __future__ import annotations

import hashlib
import json
import logging

import numpy as np

from parallama.data.datasets import ResumableDistributedSampler
from parallama.errors import ConfigError
from parallama.runtime import compat

log = logging.getLogger("parallama")

GENESIS = "0" * 64  # the running hash before any batch
GLOBAL_BATCH = "global batch (data.batch_size x data-parallel size x trainer.accumulate_grad_batches)"
_OLD_WORLD = "world size (trainer.devices x trainer.num_nodes)"  # per-rank positions (before global ones)


def fold(digest: str, indices: np.ndarray) -> str:
    """One link of the running hash: sha256 of the previous digest's 32 bytes and the global batch's sample
    indices (in data-order position) as little-endian int64."""
    return hashlib.sha256(bytes.fromhex(digest) + np.asarray(indices, "<i8").tobytes()).hexdigest()


def saved_position(state: dict, source: str) -> tuple[int, int]:
    """(epoch, global samples consumed in it) of a checkpoint's data state. Older checkpoints counted per
    rank: times their world size that is the same number; without the world size it cannot be known."""
    if "global_consumed" in state:
        return state["epoch"], state["global_consumed"]
    if _OLD_WORLD not in state:
        raise ConfigError(
            f"{source} stores its data position per rank without its world size: it cannot be resumed exactly; "
            "start a new run (init_from=...) or resume it with the parallama version that wrote it"
        )
    return state["epoch"], state["consumed"] * state[_OLD_WORLD]


class TrainPosition:
    """The train loader's place in the data order and the record of what was trained.

    Global batch j of an epoch is positions [offset + j*B, offset + (j+1)*B) of the epoch's order (B = per-rank
    batch x data-parallel size; offset is non-zero only in an epoch resumed under another B). A batch is folded
    into the hash (and the index log) once Lightning has processed it, so a checkpoint's hash covers exactly
    the samples its weights were trained on.
    """

    def __init__(self, sampler: ResumableDistributedSampler, batch_size: int, index_log: str | None):
        self.sampler, self.batch_size, self.index_log = sampler, batch_size, index_log
        self.global_batch = batch_size * sampler.num_replicas
        self._offset = (0, 0)  # (epoch, samples before Lightning's batch 0 of that epoch)
        self.digest, self.samples = GENESIS, 0  # running hash over every trained global batch, their samples
        self._pending: tuple[int, int, int, np.ndarray] | None = None  # (epoch, end, step, indices) in flight

    def position(self, epoch: int, batches: int) -> int:
        """Global samples of `epoch` before Lightning's batch number `batches`."""
        return batches * self.global_batch + (self._offset[1] if epoch == self._offset[0] else 0)

    def consumed(self, trainer) -> int:
        return self.position(trainer.current_epoch, compat.batch_progress(trainer).current.processed)

    def restore(self, state: dict, trainer, source: str) -> None:
        """Continue at the checkpoint's global sample: the sampler starts there, and Lightning's batch count
        (which decides where its epoch ends) becomes the batches of this size that fit before the end."""
        epoch, at = saved_position(state, source)
        self.digest, self.samples = state.get("trained_hash", GENESIS), state.get("trained_samples", 0)
        progress = compat.batch_progress(trainer)
        n, size = len(self.sampler.dataset), self.global_batch
        left = max(n - at, 0) // size
        batches = n // size - left
        shift = batches - progress.current.processed
        if shift:
            current = progress.current
            current.ready, current.started = current.ready + shift, current.started + shift
            current.processed, current.completed = current.processed + shift, current.completed + shift
            progress.is_last_batch = left == 0
        self._offset = (epoch, at - batches * size)
        self.sampler.start_at(epoch, at)
        new = size * trainer.accumulate_grad_batches
        old = state.get(GLOBAL_BATCH, new)
        if old != new and self.sampler.rank == 0:
            log.warning(
                f"resuming with {new} samples per optimizer step (data.batch_size x data-parallel size x "
                f"trainer.accumulate_grad_batches = {self.batch_size} x {self.sampler.num_replicas} x "
                f"{trainer.accumulate_grad_batches}) where the checkpoint's run had {old}; training continues "
                f"at the same sample; set global_batch_size={old} to keep the checkpoint's"
            )

    def received(self, index, trainer) -> None:
        """Check, on the host before the batch moves to the device, that this rank got its share of the
        global batch the data order puts next; the batch is hashed once processed."""
        self.settle(trainer)
        epoch = trainer.current_epoch
        start = self.position(epoch, compat.batch_progress(trainer).current.ready)
        indices = self.sampler.order(epoch)[start : start + self.global_batch]
        share = indices[self.sampler.rank :: self.sampler.num_replicas]
        if not np.array_equal(index.numpy(), share):
            raise RuntimeError(
                f"data: rank {self.sampler.rank} received samples {index.tolist()} at global position {start} of "
                f"epoch {epoch}, but the data order gives it {share.tolist()}"
            )
        self._pending = (epoch, start + self.global_batch, trainer.global_step, indices)

    def settle(self, trainer) -> None:
        """Fold the batch in flight into the hash (and log it) if Lightning has processed it."""
        if self._pending is None:
            return
        epoch, end, step, indices = self._pending
        if trainer.current_epoch == epoch and self.consumed(trainer) < end:
            return
        self.digest, self.samples, self._pending = (
            fold(self.digest, indices),
            self.samples + len(indices),
            None,
        )
        if self.index_log:
            with open(self.index_log, "a") as f:
                f.write(json.dumps({"step": step, "epoch": epoch, "indices": indices.tolist()}) + "\n")

    def state(self, trainer) -> dict:
        self.settle(trainer)
        return {
            "epoch": trainer.current_epoch,
            "global_consumed": self.consumed(trainer),
            GLOBAL_BATCH: self.global_batch * trainer.accumulate_grad_batches,
            "trained_samples": self.samples,
            "trained_hash": self.digest,
        }

    def summary(self) -> str:
        return f"trained {self.samples:,} samples, running hash {self.digest}"
