"""The Qwen3-MoE family (e.g. Qwen3-30B-A3B): Qwen3's attention (QK-norm) with a mixture-of-experts feed-forward
(models/moe.py) in every `decoder_sparse_step`-th block outside `mlp_only_layers`, the Llama's SwiGLU MLP in the
others. Built from the qwen3 and llama parts: this file (`Qwen3MoeConfig`, `SPEC`), model.py (the block that
picks its feed-forward), parallelize.py (qwen3's plan, the experts sharded by models/moe_parallel.py) and hf.py
(Hugging Face folders: per-expert tensors on disk, fused in memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallama.models import ModelSpec
from parallama.models.moe import SCORE_FUNCS
from parallama.models.qwen3 import Qwen3Config

Coefficient = float  # >= 0 (LlamaConfig's check asks floats to be > 0; these are checked here)


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """Hugging Face ``Qwen3MoeConfig`` field names and semantics, plus the router's training options that
    transformers does not have (`router_z_loss_coef`, `router_bias_update_rate`, `router_score_func`: a folder
    with other than their defaults is refused on export where transformers would run another model)."""

    hf_model_type = "qwen3_moe"
    hf_architecture = "Qwen3MoeForCausalLM"
    dense_weights = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    expert_weights = (
        "gate_proj",
        "up_proj",
        "down_proj",
    )  # on disk, per expert: mlp.experts.<e>.<name>.weight
    training_fields = (
        *Qwen3Config.training_fields,
        "router_aux_loss_coef",
        "router_z_loss_coef",
        "router_bias_update_rate",
    )

    intermediate_size: int = 6144  # the dense MLP of `mlp_only_layers`
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    router_aux_loss_coef: Coefficient = 0.001
    router_z_loss_coef: Coefficient = 0.0
    router_bias_update_rate: Coefficient = 0.0  # > 0: DeepSeek-V3's loss-free balancing (a per-expert bias)
    router_score_func: str = "softmax"

    def __post_init__(self):
        super().__post_init__()
        self.mlp_only_layers = list(self.mlp_only_layers)
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"model.{name}={value!r} must be a number >= 0")
        if self.router_score_func not in SCORE_FUNCS:
            raise ValueError(f"model.router_score_func={self.router_score_func!r}: use one of {SCORE_FUNCS}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"model.num_experts_per_tok={self.num_experts_per_tok} must be <= model.num_experts="
                f"{self.num_experts}"
            )
        bad = [i for i in self.mlp_only_layers if not (type(i) is int and 0 <= i < self.num_hidden_layers)]
        if bad:
            raise ValueError(
                f"model.mlp_only_layers has {bad[0]!r}; use layer indices in [0, {self.num_hidden_layers})"
            )

    @classmethod
    def from_hf_dict(cls, d: dict) -> Qwen3MoeConfig:
        """The Hub's config.json says `num_experts`; transformers 5 writes it as `num_local_experts`."""
        if "num_local_experts" in d:
            d = {"num_experts": d["num_local_experts"], **d}
        return super().from_hf_dict(d)

    def is_sparse(self, layer: int) -> bool:
        """Whether block `layer` is a mixture of experts (Hugging Face's rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def moe_params(self) -> int:
        """One mixture-of-experts feed-forward's parameters: the router and every expert."""
        return self.num_experts * (self.hidden_size + 3 * self.hidden_size * self.moe_intermediate_size)

    def block_params(self) -> tuple[int, int]:
        """A sparse block's (the planner's per-block figure; `num_params` counts each block as it is)."""
        (matmuls, norms), dense = super().block_params(), 3 * self.hidden_size * self.intermediate_size
        return matmuls - dense + self.moe_params(), norms

    def num_params(self, non_embedding: bool = False) -> int:
        """Every parameter, all experts included (what memory holds)."""
        dense_blocks = sum(not self.is_sparse(i) for i in range(self.num_hidden_layers))
        extra = (
            3 * self.hidden_size * (self.intermediate_size - self.moe_intermediate_size * self.num_experts)
        )
        return super().num_params(non_embedding) + dense_blocks * (
            extra - self.num_experts * self.hidden_size
        )

    def active_params(self, non_embedding: bool = False) -> int:
        """The parameters one token runs through: the router and `num_experts_per_tok` experts per sparse block."""
        sparse = sum(self.is_sparse(i) for i in range(self.num_hidden_layers))
        idle = (
            (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        )
        return self.num_params(non_embedding) - sparse * idle

    def flops_per_token(self, seq_len: int) -> float:
        """6 per active non-embedding parameter plus attention (the Llama's count, with the active experts)."""
        attn = 12 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        return float(6 * self.active_params(non_embedding=True) + attn)

    def hf_keys(self) -> set[str]:
        """The tensors of a Hugging Face Qwen3-MoE checkpoint on disk: experts one by one."""
        keys = super().hf_keys()
        for i in range(self.num_hidden_layers):
            if self.is_sparse(i):
                keys -= {f"model.layers.{i}.{name}.weight" for name in self.dense_weights}
                keys.add(f"model.layers.{i}.mlp.gate.weight")
                keys |= {
                    f"model.layers.{i}.mlp.experts.{e}.{name}.weight"
                    for e in range(self.num_experts)
                    for name in self.expert_weights
                }
        return keys


SPEC = ModelSpec(
    "qwen3_moe",
    Qwen3MoeConfig,
    f"{__name__}.model.Qwen3Moe",
    f"{__name__}.parallelize.parallelize",
    hf_path=f"{__name__}.hf",
    hf_model_type=Qwen3MoeConfig.hf_model_type,
)
