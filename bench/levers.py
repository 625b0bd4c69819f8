"""Levers `python -m bench train-gpu` measures before parallama adopts them: callbacks an arm adds to the user's
command (`+callbacks.<name>._target_=bench.levers.<Class>`), so a candidate runs side by side with the default in
one call without becoming a setting first.
"""

from __future__ import annotations

import lightning as L
import torch


class ResidualInComputeDtype(L.Callback):
    """The residual stream between blocks in autocast's compute dtype (bf16), as FSDP2's and DeepSpeed's bf16
    parameters give it, instead of the fp32 that autocast leaves the embedding's output in: every norm and
    residual add then reads and writes half the bytes (about 4 ms of a 1B step of 8,192 tokens on an H100, by
    arithmetic). A hook on the embedding's output; a no-op without autocast (CPU's 32-true)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.model.embed_tokens.register_forward_hook(in_compute_dtype)


def in_compute_dtype(module, inputs, output: torch.Tensor) -> torch.Tensor:
    device = output.device.type
    return output.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else output
