"""What a parallelize plan applies to every block of any family's model (models/contract.py: `layers`, the input
and output modules): activation checkpointing, compile and FSDP2, each an `apply_*` function with explicit
arguments, and the check that a tensor-parallel plan covered every parameter. A family's plan
(models/<family>/parallelize.py) calls them in its order; no Lightning here: bench/ and tests call them on a bare
model.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallama.errors import ConfigError

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_tp_plan_covers(model: nn.Module, mesh, replicated: set[str], plan: str = "") -> None:
    """Every parameter is a DTensor on the tp `mesh` or belongs to a module the plan keeps `REPLICATED`: a
    parameter the plan missed would be a plain tensor that each rank updates from its own share of the
    activations (a model that is not the one-process model, silently), so it is one line naming it."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        covered = isinstance(param, DTensor) and param.device_mesh == mesh
        if not covered and name.rpartition(".")[0] not in replicated:
            raise ConfigError(
                f"strategy.tp={mesh.size()}: the model's {name} is not covered by the tensor-parallel plan "
                f"{plan} (each rank would train its own copy from its share of the activations); add its module "
                "to the family's block plan (its SPEC's parallelize) or use strategy.tp=1"
            )


def apply_ac(model: nn.Module) -> None:
    """Activation checkpointing: each block recomputes its activations in backward instead of storing them."""
    for block in model.layers.values():
        checkpoint_forward(block)


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block, in place: parameter names (and so checkpoints) stay the same."""
    for block in model.layers.values():
        block.compile()


def apply_fsdp(
    model: nn.Module,
    mesh,
    *,
    reshard_after_forward: bool = True,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
) -> None:
    """FSDP2: `fully_shard` each block over `mesh`, then the root. A 1-D mesh shards (FSDP); a 2-D one
    (dp_replicate, dp_shard) shards on its second dimension and replicates on its first (HSDP).

    mixed_precision: None (compute in the parameters' dtype), "bf16" or "fp16": compute in that dtype, reduce
    gradients in fp32, keep fp32 master weights. cpu_offload: sharded parameters, gradients and optimizer
    state live in CPU memory.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"mesh": mesh}
    if mixed_precision is not None:
        dtype = MIXED_PRECISION_DTYPES[mixed_precision]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cpu_offload:  # pinned host memory (faster copies) needs an accelerator; on CPU the shards stay put
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    for i, block in enumerate(model.layers.values()):
        # The last block's parameters are needed again right away by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(model.layers) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


def checkpoint_forward(block: nn.Module) -> None:
    """Recompute the block in backward instead of storing its activations. Keeps state-dict keys unchanged."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed
