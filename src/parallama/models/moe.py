"""A mixture-of-experts feed-forward block for any family: token-choice top-k routing, dropless, the experts as
stacked weights run by one grouped GEMM (torch's, through runtime/compat.py), and the router's training losses (load balancing over the global batch,
router z-loss) or DeepSeek-V3's loss-free bias balancing.

Read top to bottom: `TopKRouter` picks each token's experts; `GroupedExperts` runs every expert on the tokens sent
to it, sorted by expert (`torch._grouped_mm`); `MoE` routes, sorts, combines and adds optional shared experts.
Parameter names follow Hugging Face's Qwen3-MoE (`mlp.gate.weight`, `mlp.experts.gate_up_proj` (E, 2I, H),
`mlp.experts.down_proj` (E, H, I)), so a block maps 1:1 onto transformers' fused expert tensors.

Expert parallelism (models/moe_parallel.py) shards the experts' first dimension over ranks and wraps
`GroupedExperts.forward` in an all-to-all dispatch and combine; nothing here knows about it, except that a weight
may arrive as a DTensor, whose local shard is this rank's experts, and that the experts' call runs in
`MoE.experts_context` (set there under per-op selective checkpointing).

The losses are computed after the forward (`auxiliary_loss`), from what each block recorded: the tokens each
expert received are summed over the ranks that hold other tokens (`MoE.count_group`, set by the parallel plan)
before the load-balancing loss reads them, so the loss and its gradient are those of the global batch in every
data-parallel layout (Qwen's global-batch balancing, Megatron's global_aux_loss). In a pipeline stage
(`StageLosses`) each block adds its losses' gradient in backward, the shares of the whole step's tokens (every
microbatch's) read when that backward runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from parallama.runtime import compat

SCORE_FUNCS = ("softmax", "sigmoid")


class TopKRouter(nn.Module):
    """Each token's `top_k` experts and their weights from a linear score per expert.

    softmax (Qwen, Mixtral): weights are the chosen probabilities, renormalized to sum to 1 if `norm_topk_prob`.
    sigmoid (DeepSeek-V3): independent scores, the chosen ones normalized if `norm_topk_prob`.
    `bias_update_rate` > 0: DeepSeek-V3's loss-free balancing, a per-expert bias added to the scores for the
    choice only (not the weights), moved after each optimizer step towards the under-loaded experts."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        bias_update_rate: float = 0.0,
    ):
        super().__init__()
        self.top_k, self.score_func, self.norm_topk_prob = top_k, score_func, norm_topk_prob
        self.bias_update_rate = bias_update_rate
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if bias_update_rate:
            self.register_buffer("expert_bias", torch.zeros(num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (N, H) -> weights (N, k) in x's dtype, experts (N, k), scores (N, E) and logits (N, E) in fp32."""
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if self.bias_update_rate else scores
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts, scores, logits

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: Tensor) -> None:
        """Loss-free balancing: raise the bias of experts below the mean load, lower the others'."""
        self.expert_bias += self.bias_update_rate * torch.sign(tokens_per_expert.mean() - tokens_per_expert)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs as stacked weights: gate and up fused as Hugging Face stores them in memory
    (gate_up_proj (E, 2I, H): gate rows first), down_proj (E, H, I)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """x (N, H): tokens sorted by expert, `tokens_per_expert[e]` of them for expert e (this rank's experts
        under expert parallelism, whose weights are then DTensors sharded on the expert dimension)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if isinstance(gate_up, DTensor):  # (torch.compile reads hasattr(gate_up, "to_local") as False)
            gate_up, down = gate_up.to_local(), down.to_local()
        offsets = tokens_per_expert.cumsum(0).to(torch.int32)
        gate, up = compat.grouped_mm(x, gate_up, offsets).chunk(2, dim=-1)
        return compat.grouped_mm(F.silu(gate) * up, down, offsets)


@dataclass
class Routing:
    """What a block's forward recorded for its losses: this rank's tokens per expert (E,), the mean routing
    probability per expert over this rank's tokens (E,), and the mean squared log-partition of its logits."""

    tokens_per_expert: Tensor
    mean_probs: Tensor
    z: Tensor


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


class MoE(nn.Module):
    """The feed-forward of a mixture-of-experts block: each token goes to its router's top-k experts, their
    outputs weighted and summed; no capacity, no token dropped. `shared_experts` (an MLP of `shared_mlp`, built
    by the family) sees every token and is added (DeepSeek's shared experts; None: none).

    aux_loss_coef: weight of the load-balancing loss E * sum_e f_e * P_e (f_e: the share of the global batch's
    tokens routed to e, summing to top_k; P_e: e's mean probability), Hugging Face's normalization, per block.
    z_loss_coef: weight of the router z-loss, the mean squared log-sum-exp of the router logits (ST-MoE)."""

    # The process group whose ranks hold other tokens (models/moe_parallel.py); None: this rank alone
    count_group = None
    # In a pipeline stage: its losses added in backward (`add_losses_in_backward`)
    stage: StageLosses | None = None
    # What the experts' call runs in (models/moe_parallel.py: outside per-op selective checkpointing under ep)
    experts_context = contextlib.nullcontext

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0,
        shared_experts: nn.Module | None = None,
    ):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.gate = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            score_func=score_func,
            norm_topk_prob=norm_topk_prob,
            bias_update_rate=bias_update_rate,
        )
        self.experts = GroupedExperts(hidden_size, intermediate_size, num_experts)
        self.shared_experts = shared_experts
        self.routing: Routing | None = None  # the last training forward's, until `auxiliary_loss` reads it
        # The global tokens per expert so far this step (loss-free balancing)
        self.step_tokens: Tensor | None = None

    @torch.no_grad()
    def init_weights(self, std: float, residual_std: float) -> None:
        """N(0, std), the experts' projections into the residual stream N(0, residual_std) as the Llama's
        down_proj (the shared experts, an MLP of the family's, are initialized with the family's linears)."""
        nn.init.normal_(self.gate.weight, std=std)
        nn.init.normal_(self.experts.gate_up_proj, std=std)
        nn.init.normal_(self.experts.down_proj, std=residual_std)
        if self.gate.bias_update_rate:
            self.gate.expert_bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts, scores, logits = self.gate(x)
        tokens_per_expert = torch.bincount(experts.flatten(), minlength=self.num_experts)
        if torch.is_grad_enabled():
            probs = scores if self.gate.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
            z = torch.logsumexp(logits, dim=-1).square().mean()
            self.routing = Routing(tokens_per_expert, probs.mean(0), z)
        # Sort the (token, choice) pairs by expert: each expert's tokens are one contiguous run.
        order = experts.flatten().argsort(stable=True)
        token = order // self.top_k
        routed = x[token]
        with self.experts_context():
            y = self.experts(routed, tokens_per_expert)
        y = y * weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, token, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.stage is not None and self.routing is not None:
            routing, self.routing = self.routing, None
            # An activation checkpoint's recomputation (a forward run inside backward) records nothing more.
            if not compat.recomputing_in_backward():
                detached = Routing(routing.tokens_per_expert, routing.mean_probs.detach(), routing.z.detach())
                self.stage.forwards.append(detached)
            out = _AddRouterLossGradient.apply(out, routing.mean_probs, routing.z, self)
        return out.reshape(shape)

    def balance_loss(self, counts: Tensor, mean_probs: Tensor) -> Tensor:
        """The load-balancing loss E x sum_e f_e P_e of tokens routed `mean_probs` (P_e), whose global counts per
        expert give the shares f_e (`shares`); its gradient in P is E x f (`_AddRouterLossGradient`)."""
        return self.num_experts * (self.shares(counts) * mean_probs).sum()

    def shares(self, counts: Tensor) -> Tensor:
        """f_e: each expert's share of the tokens routed, summing to top_k."""
        return counts * self.top_k / counts.sum()

    def add_step_tokens(self, counts: Tensor) -> None:
        """Under loss-free balancing: count a forward's global tokens per expert towards the step's bias update."""
        if self.gate.bias_update_rate:
            self.step_tokens = counts if self.step_tokens is None else self.step_tokens + counts

    def step_counts(self) -> Tensor:
        """In a pipeline stage: the step's tokens per expert, its last `microbatches` forwards' (torch's shape
        inference runs one before them on its first step) summed over `count_group`; one all-reduce, again only
        after another forward."""
        stage = self.stage
        if stage.counts is None or stage.counts[0] != len(stage.forwards):
            recorded = stage.forwards[-stage.microbatches :]
            counts = torch.stack([r.tokens_per_expert for r in recorded]).sum(0).float()
            if self.count_group is not None:
                dist.all_reduce(counts, group=self.count_group)
            stage.counts = (len(stage.forwards), counts)
        return stage.counts[1]


class _AddRouterLossGradient(torch.autograd.Function):
    """x unchanged; in backward the block's mean probabilities and z get the gradients of weight x (aux_loss_coef
    x E x sum_e f_e P_e + z_loss_coef x z), as if that were added to the model's loss (Megatron's
    MoEAuxLossAutoScaler, for a rank that forms no loss of the whole model), with f_e the shares of the step's
    tokens read when this backward runs (`MoE.step_counts`)."""

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
                shares = grad.new_zeros(block.num_experts, dtype=torch.float32)
            else:
                shares = block.shares(block.step_counts())
            d_probs = stage.weight * block.aux_loss_coef * block.num_experts * shares
        if block.z_loss_coef:
            d_z = torch.tensor(stage.weight * block.z_loss_coef, device=grad.device)
        return grad, d_probs, d_z, None


def moe_blocks(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


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
        aux.append(block.balance_loss(count, block.routing.mean_probs))
        z.append(block.routing.z)
        loss = loss + block.aux_loss_coef * aux[-1] + block.z_loss_coef * z[-1]
        block.add_step_tokens(count)
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
        counts = block.step_counts()
        aux = torch.stack([block.balance_loss(counts, r.mean_probs) for r in forwards]).mean()
        z = torch.stack([r.z for r in forwards]).mean()
        sums += torch.stack([block.aux_loss_coef * aux + block.z_loss_coef * z, aux, z])
        worst = torch.maximum(worst, counts.amax() / counts.mean())
        block.add_step_tokens(counts)
        block.stage = None
    sums /= num_blocks
    if group is not None:
        dist.all_reduce(sums, group=group)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return sums[0], {"aux_loss": sums[1], "router_z_loss": sums[2], "expert_imbalance": worst}
