"""The Qwen3 family (dense Qwen3 models, e.g. Qwen3-0.6B): the Llama with per-head RMSNorm of queries and keys
before rope (QK-norm) and a head_dim of its own. Built from the Llama's parts, not copies of them: this file
(`Qwen3Config`, `SPEC`), model.py (the attention with QK-norm, plugged into the Llama's block and decoder) and
parallelize.py (the Llama's plan plus the q/k norms); Hugging Face folders go through the Llama's hf.py, which
takes the family from the config class.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallama.models import ModelSpec
from parallama.models.llama.config import LlamaConfig


@dataclass
class Qwen3Config(LlamaConfig):
    """Hugging Face ``Qwen3Config`` field names. No attention biases (`attention_bias`, false in every Qwen3
    release; a folder with it is refused) and no sliding window."""

    hf_model_type = "qwen3"
    hf_architecture = "Qwen3ForCausalLM"
    layer_weights = (*LlamaConfig.layer_weights, "self_attn.q_norm", "self_attn.k_norm")

    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    head_dim: int = 128  # a field, not hidden_size / num_attention_heads (Qwen3-0.6B: 16 x 128 = 2048 > 1024)

    def check_head_dim(self) -> None:
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim={self.head_dim} must be even (rope)")

    def block_params(self) -> tuple[int, int]:
        matmuls, norms = super().block_params()
        return matmuls, norms + 2 * self.head_dim  # q_norm, k_norm: one weight of head_dim each

    def attention_activations(self) -> int:
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return super().attention_activations() + q + kv  # the q/k norms' inputs


# Hugging Face folders through the Llama's hf.py: it takes the family (model_type, tensors) from the config class
HF = dict(hf_path="parallama.models.llama.hf", hf_model_type=Qwen3Config.hf_model_type)
SPEC = ModelSpec("qwen3", Qwen3Config, f"{__name__}.model.Qwen3", f"{__name__}.parallelize.parallelize", **HF)
