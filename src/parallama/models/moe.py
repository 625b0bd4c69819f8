"""A mixture-of-experts feed-forward block for any family: token-choice top-k routing, dropless, the experts as
stacked weights run by one grouped GEMM (torch's, through runtime/compat.py); the router's training losses (load
balancing over the global batch, router z-loss) or DeepSeek-V3's loss-free bias balancing are models/moe_losses.py's.

Read top to bottom: `TopKRouter` picks each token's experts; `GroupedExperts` runs every expert on the tokens sent
to it, sorted by expert (`torch._grouped_mm`); `MoE` routes, sorts, combines and adds optional shared experts.
Parameter names follow Hugging Face's Qwen3-MoE (`mlp.gate.weight`, `mlp.experts.gate_up_proj` (E, 2I, H),
`mlp.experts.down_proj` (E, H, I)), so a block maps 1:1 onto transformers' fused expert tensors.

Expert parallelism (models/moe_parallel.py) shards the experts' first dimension over ranks and wraps
`GroupedExperts.forward` in an all-to-all dispatch and combine; nothing here knows about it, except that a weight
may arrive as a DTensor, whose local shard is this rank's experts, and that the experts' call runs in
`MoE.experts_context` (set there under per-op selective checkpointing).

A training forward records what the losses need (`Routing`: tokens per expert, mean probabilities, z), which
models/moe_losses.py reads after it (`auxiliary_loss`), or, in a pipeline stage, in its backward (`StageLosses`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from parallama.models.moe_losses import Routing, StageLosses, in_stage
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


class MoE(nn.Module):
    """The feed-forward of a mixture-of-experts block: each token goes to its router's top-k experts, their
    outputs weighted and summed; no capacity, no token dropped. `shared_experts` (an MLP of `shared_mlp`, built
    by the family) sees every token and is added (DeepSeek's shared experts; None: none).

    aux_loss_coef: weight of the load-balancing loss E * sum_e f_e * P_e (f_e: the share of the global batch's
    tokens routed to e, summing to top_k; P_e: e's mean probability), Hugging Face's normalization, per block.
    z_loss_coef: weight of the router z-loss, the mean squared log-sum-exp of the router logits (ST-MoE)."""

    # The process group whose ranks hold other tokens (models/moe_parallel.py); None: this rank alone
    count_group = None
    # In a pipeline stage: its losses added in backward (moe_losses.py `add_losses_in_backward`)
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
        self.routing: Routing | None = None  # the last training forward's, until moe_losses.py reads it
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
        if self.stage is not None and self.routing is not None:  # its losses' gradient added in backward
            out = in_stage(self, out)
        return out.reshape(shape)


def moe_blocks(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
