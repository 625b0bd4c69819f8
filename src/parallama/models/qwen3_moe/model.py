"""Qwen3-MoE: Qwen3 (models/qwen3/model.py) whose feed-forward is a mixture of experts (models/moe.py) in its
sparse blocks. Parameter names follow Hugging Face's ``Qwen3MoeForCausalLM`` in memory (`mlp.gate.weight`,
`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); hf.py maps the experts to its per-expert files.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from parallama.models import moe, moe_losses
from parallama.models.llama.model import MLP
from parallama.models.qwen3.model import Qwen3, Qwen3DecoderLayer


def moe_block(config) -> moe.MoE:
    return moe.MoE(
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
        score_func=config.router_score_func,
        norm_topk_prob=config.norm_topk_prob,
        aux_loss_coef=config.router_aux_loss_coef,
        z_loss_coef=config.router_z_loss_coef,
        bias_update_rate=config.router_bias_update_rate,
    )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def feed_forward(self, config) -> nn.Module:
        """The block's `mlp`: experts in a sparse block (`config.is_sparse`), the dense MLP elsewhere."""
        return moe_block(config) if config.is_sparse(self.layer_idx) else MLP(config)


class Qwen3Moe(Qwen3):
    decoder_layer = Qwen3MoeDecoderLayer

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        std = self.config.initializer_range
        for block in moe.moe_blocks(self):
            block.init_weights(std, std / math.sqrt(2 * self.config.num_hidden_layers))

    pipeline_group = None  # under a pipeline, its pp ranks (set by the parallel plan: parallelize.py)

    def sparse_blocks(self) -> int:
        return sum(self.config.is_sparse(i) for i in range(self.config.num_hidden_layers))

    def auxiliary_loss(self):
        """The routers' losses of the last training forward and their metrics (models/moe_losses.py); under a
        pipeline, the value and metrics of those its microbatches added in backward."""
        blocks = moe.moe_blocks(self)
        if self.pipeline_group is not None:
            device = next(self.parameters()).device  # a stage may hold no sparse block
            return moe_losses.pipeline_losses(blocks, self.sparse_blocks(), self.pipeline_group, device)
        return moe_losses.auxiliary_loss(blocks)

    def auxiliary_loss_in_backward(self, microbatches: int, accumulate: int) -> None:
        """Under a pipeline: each microbatch's router losses, weighted 1 / (microbatches x accumulation x
        sparse blocks), reach backward through the blocks' activations (only the last stage forms the recipe's
        loss), balanced by the whole step's tokens per expert."""
        weight = 1 / (microbatches * accumulate * self.sparse_blocks())
        moe_losses.add_losses_in_backward(moe.moe_blocks(self), weight, microbatches)

    def after_optimizer_step(self) -> None:
        moe_losses.update_expert_biases(moe.moe_blocks(self))
