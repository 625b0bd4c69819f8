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
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallama.errors import ConfigError

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_tp_plan_covers(model: nn.Module, mesh, replicated: set[str], plan: str = "") -> None:
    """Every parameter is a DTensor on the tp `mesh` or belongs to a module the plan keeps `REPLICATED`: a
    parameter the plan missed would be a plain tensor that each rank updates from its own share of the
    activations (a model that is not the one-process model, silently), so it is one line naming it."""

    for name, param in model.named_parameters():
        covered = isinstance(param, DTensor) and param.device_mesh == mesh
        if not covered and name.rpartition(".")[0] not in replicated:
            raise ConfigError(
                f"strategy.tp={mesh.size()}: the model's {name} is not covered by the tensor-parallel plan "
                f"{plan} (each rank would train its own copy from its share of the activations); add its module "
                "to the family's block plan (its SPEC's parallelize) or use strategy.tp=1"
            )


def apply_ac(model: nn.Module, mode: str = "full", *, policy: str = "op", every_n: int = 2) -> None:
    """Activation checkpointing of each block of `model.layers` (distributed/options.py `ACOptions`):

    - "full": each block keeps only its input and recomputes the rest in backward;
    - "selective", `policy="op"`: per-op selective checkpointing (torchtitan's): the outputs of the ops in
      `SAVE_OPS` (matmuls, attention, TP's reduce-scatter) are kept, the cheap ones (norms, rope, SiLU, products,
      residual adds) recomputed, so backward recomputes no matmul;
    - "selective", `policy="every_n"`: every n-th block (the n-th, 2n-th, ...: keys n-1, 2n-1, ...) fully
      checkpointed, the others not;
    - "none": nothing.

    Applied before compile (parallel order: TP, AC, compile, FSDP), so each compiled block traces its own
    checkpoint, as torchtitan's; state-dict keys stay the same.
    """
    if mode == "none":
        return
    if mode not in ("full", "selective") or policy not in ("op", "every_n"):
        raise ValueError(f"apply_ac: mode={mode!r}, policy={policy!r}")
    for position, (key, block) in enumerate(model.layers.items()):
        # The key, not the position, under a pipeline stage (which holds some blocks, keyed as in the model).
        index = int(key) if str(key).isdigit() else position
        if mode == "selective" and policy == "every_n":
            if (index + 1) % every_n == 0:
                checkpoint_forward(block)
        else:
            checkpoint_forward(block, selective=mode == "selective")


def _save_ops() -> set:
    """torchtitan's `_save_list` (torchtitan/distributed/activation_checkpoint.py), every matmul kept: the ops whose
    outputs selective checkpointing keeps (those that exist in this torch)."""
    names = [
        ("aten", "mm"),
        ("aten", "addmm"),
        ("aten", "bmm"),
        ("aten", "baddbmm"),
        ("aten", "_scaled_mm"),  # float8 matmuls
        ("aten", "_scaled_dot_product_flash_attention"),
        ("aten", "_scaled_dot_product_efficient_attention"),
        ("aten", "_scaled_dot_product_cudnn_attention"),
        ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
        ("aten", "_flash_attention_forward"),
        ("aten", "_efficient_attention_forward"),
        ("_c10d_functional", "reduce_scatter_tensor"),
        # The absolute maximum float8 scales by: cheap to keep, and recomputing it could round differently.
        ("aten", "max"),
    ]
    ops = set()
    for namespace, name in names:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None and "default" in packet.overloads():
            ops.add(packet.default)
    return ops


SAVE_OPS: set = set()  # filled on first use (looking up torch.ops loads the c10d functional ops)


def _selective_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """A (forward, recompute) context pair for `checkpoint(context_fn=...)`: keep SAVE_OPS' outputs."""

    if not SAVE_OPS:
        SAVE_OPS.update(_save_ops())
    return create_selective_checkpoint_contexts(_selective_policy)


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

    kwargs = fsdp_kwargs(mesh, mixed_precision, cpu_offload)
    for i, block in enumerate(model.layers.values()):
        # The last block's parameters are needed again right away by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(model.layers) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    # `head` is called apart from forward (loss.impl=fused): FSDP's hooks gather the head's weight for it too
    if hasattr(model, "head"):
        register_fsdp_forward_method(model, "head")


def fsdp_kwargs(mesh, mixed_precision: str | None = None, cpu_offload: bool = False) -> dict:
    """`fully_shard`'s mesh, mixed precision and offload policies (see `apply_fsdp`)."""

    kwargs: dict = {"mesh": mesh}
    if mixed_precision is not None:
        dtype = MIXED_PRECISION_DTYPES[mixed_precision]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cpu_offload:  # pinned host memory (faster copies) needs an accelerator; on CPU the shards stay put
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    return kwargs


def checkpoint_forward(block: nn.Module, *, selective: bool = False) -> None:
    """Recompute the block in backward instead of storing its activations (`selective`: only the ops outside
    SAVE_OPS). Keeps state-dict keys unchanged."""
    forward = block.forward
    extra = {"context_fn": selective_contexts} if selective else {}

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = checkpointed
