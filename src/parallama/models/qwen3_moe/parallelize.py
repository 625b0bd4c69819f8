"""Qwen3-MoE's parallelize plan: qwen3's (the Llama's order and tensor-parallel plan with the q/k norms), with
the mixture of experts whole on every tp rank: its input, the residual stream, is whole there (gathered first
under sequence parallel, and its output split on the sequence again), so every tp rank computes the same tokens
and the same gradients. Before that the routers learn which ranks hold other tokens (their load-balancing counts
add up over those), and with `strategy.ep` > 1 the experts are sharded over the ep ranks (models/moe_parallel.py).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, RowwiseParallel

from parallama.models.llama.parallelize import REPLICATED
from parallama.models.llama.parallelize import parallelize as llama_parallelize
from parallama.models.moe_parallel import apply_ep, set_count_group
from parallama.models.qwen3.parallelize import qwen3_block_plan


def moe_block_plan(*, sequence_parallel: bool, between) -> dict:
    """qwen3's block plan for both kinds of block (apply_tp keeps the entries a block has): the router and the
    experts REPLICATED; the dense MLP of `mlp_only_layers` column- and row-wise, its output whole. Under
    sequence parallel the feed-forward's input is gathered and its output split on the sequence at its border
    (for the dense MLP an all-reduce and a slice where the Llama reduce-scatters: one key, two kinds of block)."""

    plan = qwen3_block_plan(sequence_parallel=sequence_parallel, between=between)
    plan["mlp.down_proj"] = RowwiseParallel(output_layouts=Replicate())
    plan["mlp.gate"] = plan["mlp.experts"] = REPLICATED
    if sequence_parallel:
        plan["mlp"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    return plan


def parallelize(model, options):
    set_count_group(model, options)
    if options.dims.ep > 1:
        apply_ep(model, options)
    model = llama_parallelize(model, options, block_plan=moe_block_plan)
    if options.pipeline is not None:
        model.pipeline_group = options.mesh["pp"].get_group()
    return model
