"""The Llama's parallelize plan (torchtitan's `parallelize_llama`): `parallelize(model, options)` applies what
the strategy asks (`parallel.ParallelizeOptions`) in a fixed order, each step an `apply_*` function with explicit
arguments:

0. float8 (`apply_float8`, distributed/float8.py): the blocks' linears become torchao Float8Linears;
1. tensor parallel (`apply_tp`, on the mesh's `tp` dimension): weights become DTensors split across tp ranks,
   optionally with sequence parallel between the blocks;
2. activation checkpointing (`apply_ac`): each block's forward, including its TP communication, is recomputed
   (full), or only its cheap ops / every n-th block (selective);
3. compile (`apply_compile`): each block, TP's DTensor ops traced with it;
4. FSDP2 (`apply_fsdp`) on the data-parallel mesh: `dp_shard` (FSDP), or (dp_replicate, dp_shard) (HSDP: shard
   within a group, replicate across groups); a TP weight becomes a 2-D DTensor (dp_shard, tp).
Sharding wraps what runs, so FSDP comes last (it gathers what TP and compile expect to see). With a pipeline the
model is first split into this rank's stages (distributed/stages.py) and the rest applies to each stage.

Only tensor parallelism is the Llama's own here (which projection splits how); checkpointing, compile, FSDP and
the stage split are generic over the model contract (distributed/blocks.py, distributed/stages.py). The model in
model.py stays plain PyTorch; every block is the unit of checkpointing, compilation and sharding. No Lightning
here: bench/gpu.py and tests call the functions on a bare model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallama.distributed.blocks import apply_ac, apply_compile, apply_fsdp, check_tp_plan_covers
from parallama.distributed.float8 import apply_float8, float8_tp_style
from parallama.distributed.options import ParallelizeOptions
from parallama.distributed.stages import parallelize_pipeline
from parallama.models.llama.model import Llama


def parallelize(model: Llama, options: ParallelizeOptions, *, block_plan: BlockPlan | None = None) -> Llama:
    """Pipeline stages first (the split; the rest then applies to each stage), then tensor parallel, then
    activation checkpointing, then compile, then FSDP (sharding wraps what runs). `block_plan`: a family's
    tensor-parallel plan of one block (default `tp_block_plan`; models/qwen3 adds its q/k norms)."""
    if options.pipeline is not None:
        return parallelize_pipeline(model, options, functools.partial(parallelize, block_plan=block_plan))
    if options.float8 is not None:
        apply_float8(
            model,
            options.float8.recipe,
            emulate=options.float8.emulate,
            filter=options.float8.filter,
            fsdp_all_gather=options.fsdp is not None and options.dims.dp_shard * options.dims.cp > 1,
        )
    if options.dims.tp > 1:
        apply_tp(
            model,
            options.mesh["tp"],
            sequence_parallel=options.sequence_parallel,
            loss_parallel=options.loss_parallel,
            block_plan=block_plan or tp_block_plan,
            float8=options.float8 is not None,
        )
    if (ac := options.activation_checkpointing).enabled:
        apply_ac(model, ac.mode, policy=ac.policy, every_n=ac.every_n)
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
    the cp ranks are folded into dp_shard (they average their gradients too: distributed/context.py)."""
    from parallama.distributed.context import data_parallel_mesh as with_cp  # start-up time (tokenizers)

    return with_cp(options.mesh, options.dims)


# A plan's value for a module whose parameters stay plain tensors, whole on every tp rank: only correct where its
# input is whole on every rank too (the norms between blocks without sequence parallel), so that every rank
# computes the same gradient.
REPLICATED = "replicated"
# A family's plan of one block: (sequence_parallel=, between=) -> {module name in the block: style or REPLICATED}
BlockPlan = Callable[..., dict]


def tp_block_plan(*, sequence_parallel: bool, between) -> dict:
    """The Llama block's tensor-parallel plan (see `apply_tp`); `between`: the residual stream's layout between
    blocks (Shard(1) under sequence parallel, else Replicate())."""

    plan = {
        "input_layernorm": REPLICATED,
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=between),
        "post_attention_layernorm": REPLICATED,
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
    return plan


def apply_tp(
    model: Llama,
    mesh,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    block_plan: BlockPlan = tp_block_plan,
    float8: bool = False,
) -> None:
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

    `float8`: the blocks' linears are torchao Float8Linears (distributed/float8.py): their column- and row-wise
    styles become torchao's float8 ones.

    `block_plan` gives each block's plan (a family's own: models/qwen3). Every parameter must then be a DTensor
    on `mesh` or one the plan keeps `REPLICATED`: one it does not cover is refused (`check_tp_plan_covers`).
    """

    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between blocks
    root = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    root["norm"] = SequenceParallel() if sequence_parallel else REPLICATED
    replicated = {name for name, style in root.items() if style is REPLICATED}
    present = {name for name, _ in model.named_children()}  # a pipeline stage holds some of them
    parallelize_module(model, mesh, {k: v for k, v in root.items() if k in present and k not in replicated})
    if model.config.tie_word_embeddings:  # both are Shard(0) on the vocabulary: one parameter again
        model.lm_head.weight = model.embed_tokens.weight
    for key, block in model.layers.items():
        plan = block_plan(sequence_parallel=sequence_parallel, between=between)
        modules = dict(
            block.named_modules()
        )  # a family's blocks may differ (models/qwen3_moe: MLP or experts)
        plan = {name: style for name, style in plan.items() if name in modules}
        if float8:
            plan = {name: float8_tp_style(style) for name, style in plan.items()}
        replicated |= {f"layers.{key}.{name}" for name, style in plan.items() if style is REPLICATED}
        parallelize_module(block, mesh, {k: v for k, v in plan.items() if v is not REPLICATED})
    check_tp_plan_covers(model, mesh, replicated, f"{block_plan.__module__}.{block_plan.__qualname__}")
