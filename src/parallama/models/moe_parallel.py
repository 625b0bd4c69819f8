"""The parallel side of mixture-of-experts blocks (models/moe.py), for any family's plan: which ranks' tokens a
router's load-balancing counts add up over (`set_count_group`), and expert parallelism (`apply_ep`,
`strategy.ep`): each block's experts sharded over the ep ranks, tokens sent to the rank of their expert and back
with `all_to_all_single` (uneven splits), the experts' shards FSDP-sharded over the data-parallel ranks ep does
not use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from parallama.distributed.blocks import fsdp_kwargs
from parallama.models.moe import GroupedExperts, moe_blocks
from parallama.runtime import compat

_groups: dict = {}  # (dims, tuple of ranks) -> the process group, made once per layout


def batch_ranks(dims, rank: int) -> list[int]:
    """The ranks that hold other tokens than `rank` in the same model part: those that differ from it on
    dp_replicate, dp_shard or cp only (same pp stage, same tp rank)."""
    mine = dims.coordinates(rank)
    return [r for r in range(dims.world_size) if all(dims.coordinates(r)[d] == mine[d] for d in ("pp", "tp"))]


def set_count_group(model, options) -> None:
    """Every block's routers add up their tokens per expert over the ranks that hold other tokens of the step
    (models/moe_losses.py `auxiliary_loss`): the load-balancing loss is the global batch's under every layout."""
    dims = options.dims
    if dims.dp_size * dims.cp == 1 or not dist.is_initialized():
        return
    if dims.dp_size * dims.cp == dims.world_size:
        group = dist.group.WORLD
    else:  # every rank makes every group, in the same order (new_group's rule)
        partition = sorted({tuple(batch_ranks(dims, r)) for r in range(dims.world_size)})
        key = (dims, tuple(partition))
        if key not in _groups:
            _groups[key] = {ranks: dist.new_group(list(ranks)) for ranks in partition}
        group = _groups[key][tuple(batch_ranks(dims, dist.get_rank()))]
    for block in moe_blocks(model):
        block.count_group = group


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits, whose backward sends the gradients back the way they came."""

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallel:
    """One block's experts over the `ep` ranks of `mesh` (torchtitan's ExpertParallel): rank r holds experts
    r * E/ep ... (r+1) * E/ep - 1 (their weights DTensors sharded on the expert dimension). Around the experts'
    forward, which takes tokens sorted by expert and the tokens per expert:

    dispatch: the counts go to every rank (all-to-all), then each token to its expert's rank (all-to-all, uneven
        splits), and the received tokens, grouped by source rank, are regrouped by local expert;
    combine: the outputs go back in their source's order (the inverse all-to-all)."""

    def __init__(self, experts: GroupedExperts, mesh):
        self.group, self.ep = mesh.get_group(), mesh.size()

        def shard(name, module, mesh):
            for key, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(key, torch.nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        distribute_module(experts, mesh, shard, self.dispatch, self.combine)

    def dispatch(self, module, inputs, mesh):
        x, tokens_per_expert = inputs
        sent = tokens_per_expert.view(self.ep, -1)  # (destination rank, its experts)
        received = torch.empty_like(tokens_per_expert)
        dist.all_to_all_single(received, tokens_per_expert, group=self.group)
        received = received.view(self.ep, -1)  # (source rank, this rank's experts)
        self.input_splits, self.output_splits = sent.sum(1).tolist(), received.sum(1).tolist()
        x = _AllToAll.apply(x, self.output_splits, self.input_splits, self.group)
        local = received.shape[1]
        segment = torch.repeat_interleave(torch.arange(received.numel(), device=x.device), received.flatten())
        self.order = ((segment % local) * self.ep + segment // local).argsort(stable=True)
        return x[self.order], received.sum(0)

    def combine(self, module, y, mesh):
        y = y[self.order.argsort()]
        return _AllToAll.apply(y, self.input_splits, self.output_splits, self.group)


def apply_ep(model, options) -> None:
    """Expert parallelism (`strategy.ep`, options.dims.ep > 1) on every mixture-of-experts block of `model`,
    before the family's plan: each block's experts sharded over the ep ranks with all-to-all dispatch and combine
    (`ExpertParallel`), then FSDP2 on their shards over the data-parallel ranks ep does not use (dp_shard // ep,
    and dp_replicate), before FSDP wraps the blocks (which then leaves the experts to it). Each expert's gradient
    adds up its tokens from the whole ep group: FSDP divides it by the data-parallel size, not by its mesh's."""

    dims = options.dims
    mesh = dims.build_expert_mesh(options.mesh.device_type)
    dp = ("dp_replicate", "dp_shard_mod_ep") if dims.dp_replicate > 1 else "dp_shard_mod_ep"
    fsdp = options.fsdp
    ac = options.activation_checkpointing
    for block in moe_blocks(model):
        ExpertParallel(block.experts, mesh["ep"])
        if ac.mode == "selective" and ac.policy == "op":
            block.experts_context = compat.outside_selective_checkpointing  # recomputed whole
        if fsdp is not None:
            kwargs = fsdp_kwargs(mesh[dp], fsdp.mixed_precision, fsdp.cpu_offload)
            fully_shard(block.experts, reshard_after_forward=fsdp.reshard_after_forward, **kwargs)
            block.experts.set_gradient_divide_factor(dims.dp_size)
            # gloo has no PREMUL_SUM: sum, then divide (not on one rank, where torch 2.13 would divide twice)
            if mesh.device_type == "cpu" and mesh[dp].size() > 1:
                block.experts.set_force_sum_reduction_for_comms(True)
