"""The router's training losses of models/moe.py's blocks: load balancing over the global batch and the router
z-loss, computed after the forward (`auxiliary_loss`) from what each block recorded (`Routing`), and DeepSeek-V3's
loss-free bias balancing moved after each optimizer step (`update_expert_biases`).

The tokens each expert received are summed over the ranks that hold other tokens (`MoE.count_group`, set by the
parallel plan) before the load-balancing loss reads them, so the loss and its gradient are those of the global batch
in every data-parallel layout (Qwen's global-batch balancing, Megatron's global_aux_loss). In a pipeline stage
(`StageLosses`) each block adds its losses' gradient in backward, the shares of the whole step's tokens (every
microbatch's) read when that backward runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from parallama.runtime import compat


@dataclass
class Routing:
    """What a block's forward recorded for its losses: this rank's tokens per expert (E,), the mean routing
    probability per expert over this rank's tokens (E,), and the mean squared log-partition of its logits."""

    tokens_per_expert: Tensor
    mean_probs: Tensor
    z: Tensor


class MoE(Protocol):
    """What the losses read and set of a block (moe.py `MoE`), stated here so that this module needs no import
    of the block that imports it."""

    num_experts: int
    top_k: int
    aux_loss_coef: float
    z_loss_coef: float
    gate: torch.nn.Module  # TopKRouter: `bias_update_rate`, `update_bias`
    count_group: dist.ProcessGroup | None
    routing: Routing | None
    stage: StageLosses | None
    step_tokens: Tensor | None


@dataclass
class StageLosses:
    """A pipeline stage's block, whose rank forms no loss of the whole model: its router losses reach backward
    through its activations, weighted `weight`, their balancing shares those of the step's `microbatches`
    forwards (over the ranks that hold other tokens): the global batch's, as without a pipeline. A schedule
    that runs every forward of a step before its first backward (gpipe) has them all when the first backward
    needs them; parallel/layout_checks.py refuses the others."""

    weight: float
    microbatches: int
    # this step's, detached (on its first step torch's shape inference comes first)
    forwards: list[Routing] = field(default_factory=list)
    # with the load-balancing loss: how many forwards each backward came after
    backwards_saw: list[int] = field(default_factory=list)
    counts: tuple[int, Tensor] | None = None  # (forwards, the step's global tokens per expert then)


def balance_loss(block: MoE, counts: Tensor, mean_probs: Tensor) -> Tensor:
    """The load-balancing loss E x sum_e f_e P_e of tokens routed `mean_probs` (P_e), whose global counts per
    expert give the shares f_e (`shares`); its gradient in P is E x f (`_AddRouterLossGradient`)."""
    return block.num_experts * (shares(block, counts) * mean_probs).sum()


def shares(block: MoE, counts: Tensor) -> Tensor:
    """f_e: each expert's share of the tokens routed, summing to top_k."""
    return counts * block.top_k / counts.sum()


def add_step_tokens(block: MoE, counts: Tensor) -> None:
    """Under loss-free balancing: count a forward's global tokens per expert towards the step's bias update."""
    if block.gate.bias_update_rate:
        block.step_tokens = counts if block.step_tokens is None else block.step_tokens + counts


def step_counts(block: MoE) -> Tensor:
    """In a pipeline stage: the step's tokens per expert, its last `microbatches` forwards' (torch's shape
    inference runs one before them on its first step) summed over `count_group`; one all-reduce, again only
    after another forward."""
    stage = block.stage
    if stage.counts is None or stage.counts[0] != len(stage.forwards):
        recorded = stage.forwards[-stage.microbatches :]
        counts = torch.stack([r.tokens_per_expert for r in recorded]).sum(0).float()
        if block.count_group is not None:
            dist.all_reduce(counts, group=block.count_group)
        stage.counts = (len(stage.forwards), counts)
    return stage.counts[1]


def in_stage(block: MoE, out: Tensor) -> Tensor:
    """A pipeline stage's block after its forward: this forward's routing recorded for the step, and `out` with
    its losses' gradient added in backward (`_AddRouterLossGradient`)."""
    routing, block.routing = block.routing, None
    # An activation checkpoint's recomputation (a forward run inside backward) records nothing more.
    if not compat.recomputing_in_backward():
        detached = Routing(routing.tokens_per_expert, routing.mean_probs.detach(), routing.z.detach())
        block.stage.forwards.append(detached)
    return _AddRouterLossGradient.apply(out, routing.mean_probs, routing.z, block)


class _AddRouterLossGradient(torch.autograd.Function):
    """x unchanged; in backward the block's mean probabilities and z get the gradients of weight x (aux_loss_coef
    x E x sum_e f_e P_e + z_loss_coef x z), as if that were added to the model's loss (Megatron's
    MoEAuxLossAutoScaler, for a rank that forms no loss of the whole model), with f_e the shares of the step's
    tokens read when this backward runs (`step_counts`)."""

    @staticmethod
    def forward(ctx, x: Tensor, mean_probs: Tensor, z: Tensor, block: MoE) -> Tensor:
        ctx.block = block
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        block, stage = ctx.block, ctx.block.stage
        d_probs = d_z = None
        if block.aux_loss_coef:
            stage.backwards_saw.append(len(stage.forwards))
            if len(stage.forwards) < stage.microbatches:
                # torch's shape inference, before the step's forwards: its gradients are not kept
                f = grad.new_zeros(block.num_experts, dtype=torch.float32)
            else:
                f = shares(block, step_counts(block))
            d_probs = stage.weight * block.aux_loss_coef * block.num_experts * f
        if block.z_loss_coef:
            d_z = torch.tensor(stage.weight * block.z_loss_coef, device=grad.device)
        return grad, d_probs, d_z, None


def auxiliary_loss(blocks: list[MoE]) -> tuple[Tensor | float, dict[str, Tensor]]:
    """The blocks' training losses from their last forward, averaged over the blocks, and their metrics: the
    load-balancing loss and the router z-loss (unweighted), and the worst block's max/mean tokens per expert.

    One all-reduce adds up every block's tokens per expert over `count_group` first: the shares f_e are those
    of the global batch. Each rank's loss is then its own tokens' mean probabilities against those shares;
    averaging gradients over the data-parallel ranks (FSDP, DDP) makes it the global batch's loss."""
    recorded = [b for b in blocks if b.routing is not None]
    if not recorded:
        return 0.0, {}
    counts = torch.stack([b.routing.tokens_per_expert for b in recorded]).float()
    if recorded[0].count_group is not None:
        dist.all_reduce(counts, group=recorded[0].count_group)
    aux, z, loss = [], [], 0.0
    for block, count in zip(recorded, counts):
        aux.append(balance_loss(block, count, block.routing.mean_probs))
        z.append(block.routing.z)
        loss = loss + block.aux_loss_coef * aux[-1] + block.z_loss_coef * z[-1]
        add_step_tokens(block, count)
        block.routing = None
    metrics = {
        "aux_loss": torch.stack(aux).mean().detach(),
        "router_z_loss": torch.stack(z).mean().detach(),
        "expert_imbalance": (counts.amax(-1) / counts.mean(-1)).amax(),
    }
    return loss / len(recorded), metrics


def update_expert_biases(blocks: list[MoE]) -> None:
    """After an optimizer step: move each loss-free-balanced router's bias by the step's global tokens per
    expert (every micro-batch of the step, every data-parallel rank)."""
    for block in blocks:
        if block.step_tokens is not None:
            block.gate.update_bias(block.step_tokens)
            block.step_tokens = None


def add_losses_in_backward(blocks: list[MoE], weight: float, microbatches: int) -> None:
    """Before a pipeline step (the stage's rank forms no loss of the whole model): each block adds weight x its
    losses in backward at every training forward of the step's `microbatches` (`StageLosses`)."""
    for block in blocks:
        block.stage = StageLosses(weight, microbatches)


def pipeline_losses(blocks: list[MoE], num_blocks: int, group, device) -> tuple[Tensor, dict[str, Tensor]]:
    """After a pipeline step: the value (detached) and metrics of the losses its microbatches added in backward,
    over the pipeline's stages (`group`: the pp ranks, every one of which calls this; None: this rank's stages
    hold every block): the mean over the model's `num_blocks` sparse blocks of the step's losses, what
    `auxiliary_loss` gives without a pipeline for the whole batch. Raises where a backward came before a forward
    of the same step under the load-balancing loss: its shares were not the step's (a schedule
    parallel/layout_checks.py refuses)."""
    sums, worst = torch.zeros(3, device=device), torch.zeros((), device=device)
    for block in blocks:
        stage, forwards = block.stage, block.stage.forwards[-block.stage.microbatches :]
        saw = stage.backwards_saw[-stage.microbatches :]
        if block.aux_loss_coef and saw != [len(stage.forwards)] * stage.microbatches:
            raise RuntimeError(
                "a pipeline schedule ran a backward before every forward of its step: the router's load-balancing "
                "shares were not the step's (use strategy.pp_schedule=gpipe)"
            )
        counts = step_counts(block)
        aux = torch.stack([balance_loss(block, counts, r.mean_probs) for r in forwards]).mean()
        z = torch.stack([r.z for r in forwards]).mean()
        sums += torch.stack([block.aux_loss_coef * aux + block.z_loss_coef * z, aux, z])
        worst = torch.maximum(worst, counts.amax() / counts.mean())
        add_step_tokens(block, counts)
        block.stage = None
    sums /= num_blocks
    if group is not None:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return sums[0], {"aux_loss": sums[1], "router_z_loss": sums[2], "expert_imbalance": worst}
