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
    """Model hyperparameters, with Hugging Face ``LlamaConfig`` field names.

    A family shaped like the Llama subclasses it (models/qwen3): its fields, `check_head_dim`, `block_params`
    and `layer_weights` say how its blocks differ; the HF names (`hf_model_type`, `hf_architecture`) are class
    attributes, not fields."""

    hf_model_type = "llama"  # config.json's model_type
    hf_architecture = "LlamaForCausalLM"
    # One block's tensors in a HF checkpoint (`model.layers.<i>.<name>.weight`), our names without `.weight`
    layer_weights = (
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )

    # Fields that change training only, not the model a checkpoint holds: init_from does not compare them
    training_fields = ("initializer_range", "pad_vocab_multiple")
    own_fields = ("pad_vocab_multiple",)  # parallama's, not Hugging Face's: config.json does not get them

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
    # The head's matmul runs on a vocabulary padded to a multiple of this (1: as it is); what anyone sees, the
    # logits, the checkpoints and the HF folders, keeps vocab_size (model.py `Llama.logits`). Off by default: on an
    # H200 the 180M's 50000 padded to 50048 ran 0.95x (docs/benchmarks.md, `train-gpu`)
    pad_vocab_multiple: int = 1

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
        self.check_head_dim()
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        if nh % nkv:
            raise ValueError(f"model.num_key_value_heads={nkv} must divide model.num_attention_heads={nh}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type != "llama3":
                raise ValueError(f"model.rope_scaling.rope_type={rope_type!r} must be 'llama3' or unset")
            if missing := [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]:
                raise ValueError(f"model.rope_scaling is missing {missing}; llama3 needs {LLAMA3_ROPE_KEYS}")

    @property
    def head_dim(self) -> int:
        """The Llama's is hidden_size / num_attention_heads (a family may make it a field: models/qwen3)."""
        return self.hidden_size // self.num_attention_heads

    def check_head_dim(self) -> None:
        h, nh = self.hidden_size, self.num_attention_heads
        if h % nh:
            raise ValueError(f"model.num_attention_heads={nh} must divide model.hidden_size={h}")
        if (hd := self.head_dim) % 2:
            raise ValueError(f"model.hidden_size/model.num_attention_heads={hd} must be even (rope)")

    def tied_parameters(self) -> dict[str, str]:
        """Parameters that are another one (name -> the name stored): the output head with tied embeddings."""
        return {"lm_head.weight": "embed_tokens.weight"} if self.tie_word_embeddings else {}

    def to_hf_dict(self) -> dict:
        """Fields for a HF ``config.json``; callers add bos/eos token ids."""
        # Not None (rope_scaling=None: default rope), not parallama's own
        d = {k: v for k, v in asdict(self).items() if v is not None and k not in self.own_fields}
        hf = dict(architectures=[self.hf_architecture], model_type=self.hf_model_type, hidden_act="silu")
        return {**hf, "attention_bias": False, "mlp_bias": False, "head_dim": self.head_dim, **d}

    def hf_keys(self) -> set[str]:
        """The tensors of this model's Hugging Face checkpoint (what export writes and transformers loads)."""
        layers = range(self.num_hidden_layers)
        keys = {f"model.layers.{i}.{name}.weight" for i in layers for name in self.layer_weights}
        keys |= {"model.embed_tokens.weight", "model.norm.weight"}
        return keys if self.tie_word_embeddings else keys | {"lm_head.weight"}

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
        d = self.hidden_size
        n_tables = 1 if self.tie_word_embeddings or non_embedding else 2
        return self.num_hidden_layers * sum(self.block_params()) + d + n_tables * self.vocab_size * d

    def block_params(self) -> tuple[int, int]:
        """One decoder block's parameters: (its matmuls, which tensor parallelism splits; its norms, which it
        replicates)."""
        d, q, kv = (
            self.hidden_size,
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        )
        return 2 * d * q + 2 * d * kv + 3 * d * self.intermediate_size, 2 * d

    def attention_activations(self) -> int:
        """Elements per token one block's attention saves for backward between its column- and row-parallel
        projections (parallama-plan; tensor parallelism splits them): rotated q and k, v, the attention output."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return 2 * q + 2 * kv

    def flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token as PaLM / torchtitan count them: 6 per
        non-embedding parameter plus attention over ``seq_len`` keys, causal masking not discounted."""
        attn = 12 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        return float(6 * self.num_params(non_embedding=True) + attn)
