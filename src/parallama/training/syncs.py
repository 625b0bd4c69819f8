"""When the training loop reads what the device computed.

On a GPU the host queues kernels and runs ahead of them; reading a value the step computed (`.item()`, `if
tensor`, a clock after `torch.cuda.synchronize()`, a Python number logged with `self.log`, which becomes a tensor
on the device) makes the host wait until the queue is empty, and the GPU then idles while the next step is
queued. So on a GPU the default callbacks and the module read only on the steps whose metrics Lightning writes
to the loggers (every `trainer.log_every_n_steps`), which read the device anyway; on a CPU there is no queue and
they read every step, as they always did. tests/integration/test_host_syncs.py counts the reads per step.
"""

from __future__ import annotations

import torch


def device_waits(trainer) -> bool:
    """Whether reading a step's result waits for a queue of device work (a GPU), rather than costing nothing."""
    return trainer.strategy.root_device.type != "cpu"


def logging_step(trainer, step: int) -> bool:
    """Whether Lightning writes the loggers' row of optimizer step `step` (1-based: the step being taken, or the one
    just taken): every `trainer.log_every_n_steps`, under fast_dev_run, and at the run's end."""
    n = trainer.log_every_n_steps
    end = 0 < trainer.max_steps <= step or trainer.should_stop
    return bool(trainer.fast_dev_run) or end or (n > 0 and step % n == 0)


def reads_now(trainer, step: int) -> bool:
    """Whether a callback may read the device after optimizer step `step`: every step on a CPU, logging steps on a
    GPU."""
    return not device_waits(trainer) or logging_step(trainer, step)


def wait_for_device(trainer) -> None:
    """The device's queue is empty when this returns: a clock read after it times the work."""
    device = trainer.strategy.root_device
    if device.type != "cpu":  # any accelerator (device_waits' rule); a CPU has no queue
        torch.accelerator.synchronize(device)
