"""The Llama's parallelize plan (torchtitan's `parallelize_llama`): `parallelize(model, options)` applies what
the strategy asks (`parallel.ParallelizeOptions`) in a fixed order, each step an `apply_*` function with explicit
arguments.

The model in model.py stays plain PyTorch; every decoder block is the unit of checkpointing, compilation and
sharding: checkpointing wraps the block's forward, compile traces the block, FSDP shards the block and finally
the root (embedding, final norm, lm_head). No Lightning here: bench/gpu.py and tests call the functions on a
bare model.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallama.models.llama.model import Llama
from parallama.parallel.options import ParallelizeOptions

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: Llama, options: ParallelizeOptions) -> Llama:
    """Activation checkpointing, then compile, then FSDP (sharding wraps what runs)."""
    if options.activation_checkpointing:
        apply_ac(model)
    if options.compile:
        apply_compile(model)
    if options.fsdp is not None:
        fsdp = options.fsdp
        apply_fsdp(
            model,
            options.mesh["dp_shard"],
            reshard_after_forward=fsdp.reshard_after_forward,
            mixed_precision=fsdp.mixed_precision,
            cpu_offload=fsdp.cpu_offload,
        )
    return model


def apply_ac(model: Llama) -> None:
    """Activation checkpointing: each block recomputes its activations in backward instead of storing them."""
    for block in model.layers.values():
        _checkpoint_forward(block)


def apply_compile(model: Llama) -> None:
    """torch.compile each block, in place: parameter names (and so checkpoints) stay the same."""
    for block in model.layers.values():
        block.compile()


def apply_fsdp(
    model: Llama,
    mesh,
    *,
    reshard_after_forward: bool = True,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
) -> None:
    """FSDP2: `fully_shard` each block over `mesh` (a 1-D data-parallel DeviceMesh), then the root.

    mixed_precision: None (compute in the parameters' dtype), "bf16" or "fp16": compute in that dtype, reduce
    gradients in fp32, keep fp32 master weights. cpu_offload: sharded parameters, gradients and optimizer
    state live in CPU memory.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"mesh": mesh}
    if mixed_precision is not None:
        dtype = MIXED_PRECISION_DTYPES[mixed_precision]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for i, block in enumerate(model.layers.values()):
        # The last block's parameters are needed again right away by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(model.layers) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


def _checkpoint_forward(block: nn.Module) -> None:
    """Recompute the block in backward instead of storing its activations. Keeps state-dict keys unchanged."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed
