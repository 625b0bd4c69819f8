"""How often the ranks agree on a preemption signal: every step on CPUs, on GPUs every `log_every_n_steps` (no wait
for the GPU in between), or every `every_n_steps`; a signal is honoured at the first agreeing step after it."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import torch

from parallama.errors import Preempted
from parallama.training.preemption import PreemptionCheckpoint


def steps_that_agree(tmp_path, device: str, every_n_steps=None, signal_at=None, steps=25) -> tuple[list, int]:
    """The optimizer steps whose end all-reduces the flag on 2 ranks, and the step a signal stopped at (or None)."""
    reduced = []
    strategy = SimpleNamespace(
        root_device=torch.device(device),
        reduce=lambda t, reduce_op: (reduced.append(trainer.global_step), t)[1],
    )
    trainer = SimpleNamespace(
        world_size=2,
        global_step=0,
        strategy=strategy,
        log_every_n_steps=10,
        save_checkpoint=lambda *a, **k: None,
    )
    callback = PreemptionCheckpoint(str(tmp_path), every_n_steps=every_n_steps)
    for step in range(1, steps + 1):
        trainer.global_step = step
        if step == signal_at:
            callback._record(signal.SIGTERM, None)
        callback.on_train_batch_end(trainer, None, None, None, step)
        try:  # raised once Lightning has logged the step: as the next batch (or validation) starts
            callback.on_train_batch_start(trainer, None, None, step + 1)
        except Preempted:
            return reduced, step
    return reduced, None


def test_cpus_agree_every_step_gpus_on_logging_steps_or_every_n(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "tensor", lambda data, device=None: torch.as_tensor(data))  # no CUDA here
    assert steps_that_agree(tmp_path, "cpu")[0] == list(range(1, 26))
    assert steps_that_agree(tmp_path, "cuda")[0] == [10, 20]
    assert steps_that_agree(tmp_path, "cuda", every_n_steps=4)[0] == [4, 8, 12, 16, 20, 24]


@pytest.mark.parametrize(
    "device, every, at, stop", [("cpu", None, 3, 3), ("cuda", None, 3, 10), ("cuda", 4, 9, 12)]
)
def test_a_signal_stops_at_the_next_agreeing_step(tmp_path, monkeypatch, device, every, at, stop):
    monkeypatch.setattr(torch, "tensor", lambda data, device=None: torch.as_tensor(data))
    assert steps_that_agree(tmp_path, device, every_n_steps=every, signal_at=at)[1] == stop
