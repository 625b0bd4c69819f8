"""Qwen3: the Llama (models/llama/model.py) with QK-norm. Only the attention differs: an RMSNorm over head_dim,
one weight shared by all heads, applied to each query and key head after the projections and before rope.
Parameter names follow Hugging Face's ``Qwen3ForCausalLM`` (the Llama's plus ``self_attn.q_norm``/``k_norm``).
"""

from __future__ import annotations

from torch import Tensor, nn

from parallama.models.llama.model import Attention, DecoderLayer, Llama


class Qwen3Attention(Attention):
    def __init__(self, config):
        super().__init__(config)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().project(x)  # (B, T, heads, head_dim): each head normalized on its own
        return self.q_norm(q), self.k_norm(k), v


class Qwen3DecoderLayer(DecoderLayer):
    attention = Qwen3Attention


class Qwen3(Llama):
    decoder_layer = Qwen3DecoderLayer
