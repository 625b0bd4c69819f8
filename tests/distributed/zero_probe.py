"""Test-only Lightning callback (loaded with `+callbacks.probe._target_=zero_probe.ZeroProbe`): drives
parallama.checkpoint.zero inside a real multi-process DeepSpeed run, where only a running engine exists.

At the start of optimizer step `at + 1` (global_step == at) it dumps `gather_from_deepspeed` to <out>/before.pt,
writes a Lightning checkpoint to <out>/ckpt_at if `save`, and if `load` is given puts that universal state file
into the engine and dumps again to <out>/after.pt. At the end of training it dumps <out>/end.pt and writes
<out>/ckpt_end. Rank 0 writes the files; every rank takes part in the collectives.
"""

from __future__ import annotations

import os

import torch
from lightning.pytorch.callbacks import Callback

from parallama.checkpoint.zero import gather_from_deepspeed, load_into_deepspeed


class ZeroProbe(Callback):
    def __init__(self, out: str, at: int = 3, save: bool = False, load: str | None = None) -> None:
        self.out, self.at, self.save, self.load = out, at, save, load

    def _dump(self, trainer, module, name: str) -> None:
        state = gather_from_deepspeed(trainer.strategy, module)
        if trainer.global_rank == 0:
            os.makedirs(self.out, exist_ok=True)
            torch.save(state, os.path.join(self.out, name))

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step != self.at or batch_idx != self.at:
            return
        self._dump(trainer, module, "before.pt")
        if self.save:
            trainer.save_checkpoint(os.path.join(self.out, "ckpt_at"))
        if self.load:
            model, optimizer = torch.load(self.load, weights_only=True)
            load_into_deepspeed(trainer.strategy, module, model, optimizer)
            self._dump(trainer, module, "after.pt")

    def on_train_end(self, trainer, module) -> None:
        self._dump(trainer, module, "end.pt")
        trainer.save_checkpoint(os.path.join(self.out, "ckpt_end"))
