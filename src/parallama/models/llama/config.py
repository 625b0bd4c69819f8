"""The Llama's hyperparameters, `LlamaConfig` (Hugging Face field names): checked when built, naming the
Hydra key to fix; mapped to and from a HF `config.json`; counted (parameters, training FLOPs per token).

Separate from `model`, which builds the modules from it: the config is read where no model is built
(`checks` before any work, `plan`, `checkpoint`, `hf`, the MFU and parameter figures), and needs no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class LlamaConfig:
    """Model hyperparameters, with Hugging Face ``LlamaConfig`` field names."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None -> num_attention_heads (MHA); 1 -> MQA
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # only HF's {"rope_type": "llama3", ...}
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self):
        """Fail at config time, naming the Hydra key to fix, not deep inside a forward pass."""
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for f in fields(self):  # strings here (future annotations), types in a subclass that has none
            kind, value = (
                f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""),
                getattr(self, f.name),
            )
            if kind.startswith("int") and not (type(value) is int and value > 0):
                raise ValueError(f"model.{f.name}={value!r} must be a positive int")
            if kind == "float" and not value > 0:
                raise ValueError(f"model.{f.name}={value!r} must be > 0")
        h, nh, nkv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        if h % nh:
            raise ValueError(f"model.num_attention_heads={nh} must divide model.hidden_size={h}")
        if nh % nkv:
            raise ValueError(f"model.num_key_value_heads={nkv} must divide model.num_attention_heads={nh}")
        if (hd := self.head_dim) % 2:
            raise ValueError(f"model.hidden_size/model.num_attention_heads={hd} must be even (rope)")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type != "llama3":
                raise ValueError(f"model.rope_scaling.rope_type={rope_type!r} must be 'llama3' or unset")
            if missing := [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]:
                raise ValueError(f"model.rope_scaling is missing {missing}; llama3 needs {LLAMA3_ROPE_KEYS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tied_parameters(self) -> dict[str, str]:
        """Parameters that are another one (name -> the name stored): the output head with tied embeddings."""
        return {"lm_head.weight": "embed_tokens.weight"} if self.tie_word_embeddings else {}

    def to_hf_dict(self) -> dict:
        """Fields for a HF ``config.json``; callers add bos/eos token ids."""
        d = {k: v for k, v in asdict(self).items() if v is not None}  # rope_scaling=None: default rope
        hf = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")
        return {**hf, "attention_bias": False, "mlp_bias": False, "head_dim": self.head_dim, **d}

    @classmethod
    def from_hf_dict(cls, d: dict) -> LlamaConfig:
        """Build from a HF ``config.json`` dict, ignoring keys this model does not use."""
        kwargs = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        if rope := d.get("rope_parameters"):  # transformers>=5 nests theta and scaling here
            kwargs.setdefault("rope_theta", rope.get("rope_theta", cls.rope_theta))
            if rope.get("rope_type", "default") != "default":
                kwargs.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
        return cls(**kwargs)

    def num_params(self, non_embedding: bool = False) -> int:
        """Exact parameter count. ``non_embedding`` drops the token-embedding table but keeps
        ``lm_head`` (its matmul costs FLOPs); a tied table is counted once, as ``lm_head``."""
        d, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        layer = 2 * d * d + 2 * d * kv + 3 * d * self.intermediate_size + 2 * d
        n_tables = 1 if self.tie_word_embeddings or non_embedding else 2
        return self.num_hidden_layers * layer + d + n_tables * self.vocab_size * d

    def flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token as PaLM / torchtitan count them: 6 per
        non-embedding parameter plus attention over ``seq_len`` keys, causal masking not discounted."""
        attn = 12 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        return float(6 * self.num_params(non_embedding=True) + attn)
