"""The Llama's parallelize plan (torchtitan's `parallelize_llama`): `parallelize(model, options)` applies what
the strategy asks (`parallel.ParallelizeOptions`) in a fixed order, each step an `apply_*` function with explicit
arguments:

1. tensor parallel (`apply_tp`, on the mesh's `tp` dimension): weights become DTensors split across tp ranks,
   optionally with sequence parallel between the blocks;
2. activation checkpointing (`apply_ac`): each block's forward, including its TP communication, is recomputed;
3. compile (`apply_compile`): each block, TP's DTensor ops traced with it;
4. FSDP2 (`apply_fsdp`) on the data-parallel mesh: `dp_shard` (FSDP), or (dp_replicate, dp_shard) (HSDP: shard
   within a group, replicate across groups); a TP weight becomes a 2-D DTensor (dp_shard, tp).
Sharding wraps what runs, so FSDP comes last (it gathers what TP and compile expect to see).

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
    """Tensor parallel, then activation checkpointing, then compile, then FSDP (sharding wraps what runs)."""
    if options.dims.tp > 1:
        apply_tp(
            model,
            options.mesh["tp"],
            sequence_parallel=options.sequence_parallel,
            loss_parallel=options.loss_parallel,
        )
    if options.activation_checkpointing:
        apply_ac(model)
    if options.compile:
        apply_compile(model)
    if options.fsdp is not None:
        fsdp = options.fsdp
        apply_fsdp(
            model,
            data_parallel_mesh(options),
            reshard_after_forward=fsdp.reshard_after_forward,
            mixed_precision=fsdp.mixed_precision,
            cpu_offload=fsdp.cpu_offload,
        )
    return model


def data_parallel_mesh(options: ParallelizeOptions):
    """The mesh FSDP shards over: `dp_shard`, or the 2-D (dp_replicate, dp_shard) of HSDP; with context parallel
    the cp ranks are folded into dp_shard (they average their gradients too: parallel/context.py)."""
    from parallama.parallel.context import data_parallel_mesh as with_cp

    return with_cp(options.mesh, options.dims)


def apply_tp(model: Llama, mesh, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """Megatron-style tensor parallelism over `mesh` (1-D, the tp ranks), torchtitan's plan for Llama.

    Per block: q/k/v and gate/up column-wise (each rank computes its share of the heads and of the MLP's width,
    no communication), o and down row-wise (one all-reduce each, or a reduce-scatter under sequence parallel).
    The embedding is vocab-parallel (row-wise: each rank looks up its share of the vocabulary, partial sums
    reduced), the head column-wise: with `loss_parallel` its logits stay sharded on the vocabulary (the loss
    runs under `torch.distributed.tensor.parallel.loss_parallel`, never gathering them), else gathered.

    `sequence_parallel`: the norms run on 1/tp of the sequence and the residual stream between blocks stays
    split on it (activation memory / tp); attention and MLP gather it at their input (all-gather) and
    reduce-scatter at their output. Needs the sequence length to divide by tp (training and validation; not
    token-by-token decoding, see ModelParallel.inference_model).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between blocks
    root = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    parallelize_module(model, mesh, root)
    if model.config.tie_word_embeddings:  # both are Shard(0) on the vocabulary: one parameter again
        model.lm_head.weight = model.embed_tokens.weight
    for block in model.layers.values():
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=between),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            # attention(x, cos, sin, mask, kv_cache, input_pos): only x is split, and gathered on entry.
            rest = (None,) * 5
            plan["input_layernorm"] = SequenceParallel()
            plan["self_attn"] = PrepareModuleInput(
                input_layouts=(Shard(1), *rest),
                desired_input_layouts=(Replicate(), *rest),
                use_local_output=True,
            )
            plan["post_attention_layernorm"] = SequenceParallel()
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        parallelize_module(block, mesh, plan)


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
