"""The one place that applies activation checkpointing, torch.compile and FSDP2 to a model (as torchtitan does).

The model in model.py stays plain PyTorch; every decoder block is the unit of checkpointing, compilation
and sharding. Order matters: checkpointing wraps the block's forward, compile traces the block, FSDP
shards the block and finally the root (embedding, final norm, lm_head).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallama.model import Llama


def parallelize(
    model: Llama,
    strategy: object | None = None,
    *,
    compile: bool = False,
    activation_checkpointing: bool = False,
) -> Llama:
    if activation_checkpointing:
        for block in model.layers:
            _checkpoint_forward(block)
    if compile:
        for block in model.layers:
            block.compile()  # in place: parameter names stay the same
    if strategy is not None:
        from parallama.strategies import FSDP2Strategy  # imports Lightning: only when a strategy is given

        if isinstance(strategy, FSDP2Strategy):
            _apply_fsdp(model, strategy)
    return model


def _checkpoint_forward(block: nn.Module) -> None:
    """Recompute the block in backward instead of storing its activations. Keeps state-dict keys unchanged."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


def _apply_fsdp(model: Llama, strategy) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = strategy.device_mesh["data_parallel"]
    kwargs: dict = {"mesh": mesh}
    if strategy.mixed_precision is not None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[strategy.mixed_precision]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if strategy.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for i, block in enumerate(model.layers):
        # The last block's parameters are needed again right away by backward: keep them gathered.
        reshard = strategy.reshard_after_forward and i < len(model.layers) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=strategy.reshard_after_forward, **kwargs)
