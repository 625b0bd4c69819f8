"""Callbacks that need to know parallama's batch layout. Everything else in conf/callbacks is Lightning's own."""

from __future__ import annotations

from lightning.pytorch.callbacks import ThroughputMonitor


def _samples(batch: dict) -> int:
    return batch["input_ids"].size(0)


def _tokens(batch: dict) -> int:
    return batch["input_ids"].numel()


class TokenThroughputMonitor(ThroughputMonitor):
    """Lightning's ThroughputMonitor for token batches: logs tokens/s, and FLOP/s + MFU on known GPUs.

    FLOPs per batch come from the model config (6N + attention, see `LlamaConfig.flops_per_token`).
    """

    def __init__(self, window_size: int = 50, **kwargs) -> None:
        super().__init__(batch_size_fn=_samples, length_fn=_tokens, window_size=window_size, **kwargs)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        data = trainer.datamodule
        pl_module.flops_per_batch = pl_module.config.flops_per_token(data.seq_len) * data.seq_len * data.batch_size
