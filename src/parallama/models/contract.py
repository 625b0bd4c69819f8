"""The model-family contract, typed: what parallama's generic code asks of a family's model and config, checked
when a model is built (`check_model`) and a config is read (`check_config`), one line naming what a family lacks.

Generic code (distributed/blocks.py: checkpointing, compile, FSDP; distributed/stages.py: pipeline stages; generation;
the planner and the tools) uses these names only, never a family's own: a decoder is an input end, a keyed run of
blocks and an output end.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from parallama.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor, nn


@runtime_checkable
class DecoderModel(Protocol):
    """A family's model (an `nn.Module`), with parameters named as in the family's Hugging Face checkpoints.

    layers: the blocks, an `nn.ModuleDict` keyed by index: each is the unit of activation checkpointing, compile
        and FSDP, and a pipeline stage holds a contiguous run of them under their own keys.
    input_modules / output_modules: attribute names of the modules before / after the blocks (the Llama's
        `("embed_tokens",)` / `("norm", "lm_head")`): the first / last pipeline stage holds them, the others hold
        None there and pass hidden states through.
    shared_modules: what every stage keeps (buffers derived from the config: the rotary tables).

    Optional (models/qwen3_moe): `auxiliary_loss() -> (loss, {name: metric})`, the model's own training losses of
    its last forward, which `CausalLM` adds to the recipe's loss on every path and logs as `train/<name>`;
    `auxiliary_loss_in_backward(microbatches, accumulate)`, called before a pipeline's step (each stage then adds
    its own in backward, and `auxiliary_loss` gives their value); and `after_optimizer_step()`, called after each
    optimizer step (loss-free expert balancing).
    """

    config: Any
    layers: Any
    input_modules: ClassVar[tuple[str, ...]]
    output_modules: ClassVar[tuple[str, ...]]
    shared_modules: ClassVar[tuple[str, ...]]

    def forward(
        self,
        input_ids,
        attention_mask=None,
        *,
        position_ids=None,
        document_ids=None,
        input_pos=None,
        kv_cache=None,
        hidden_states=False,
    ):
        """Logits (B, T, vocab) for token ids (B, T); a stage without the input modules takes hidden states, one
        without the output modules returns them, as does `hidden_states=True` (the final ones, for `head`)."""

    def head(self, hidden, loss=None):
        """The logits of the final hidden states, or `loss(hidden, head module)` (loss.impl=fused: the head's
        matmul and the cross-entropy per chunk, training/loss.py); FSDP runs it under its hooks."""

    def init_weights(self) -> None:
        """(Re)initialize every weight and buffer: models built on the meta device are filled by this."""

    def new_kv_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> list:
        """One empty cache per block for `models.generation`."""


@runtime_checkable
class ModelConfig(Protocol):
    """A family's config: a dataclass with Hugging Face field names, checking itself when built (ValueError naming
    `model.<key>`), with the fields parallama-plan reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int

    def num_params(self, non_embedding: bool = False) -> int: ...

    def flops_per_token(self, seq_len: int) -> float: ...

    def tied_parameters(self) -> dict[str, str]: ...

    def block_params(self) -> tuple[int, int]:
        """One block's matmul and norm parameters (parallama-plan)."""

    def attention_activations(self) -> int:
        """What one block's attention saves per token for backward (parallama-plan)."""


def _missing(obj, protocol) -> list[str]:
    members = [
        *protocol.__annotations__,
        *(n for n in vars(protocol) if callable(getattr(protocol, n, None))),
    ]
    return sorted({m for m in members if not m.startswith("_") and not hasattr(obj, m)})


def check_model(model, family: str) -> None:
    """`model` offers what `DecoderModel` declares, or one line naming what it lacks."""
    if missing := _missing(model, DecoderModel):
        raise ConfigError(
            f"model.family={family}: {type(model).__name__} lacks {', '.join(missing)} of the model contract "
            "(parallama.models.contract.DecoderModel)"
        )


def parameter_count_note(model, family: str, shape=lambda p: p.shape) -> str | None:
    """One line when the config's parameter count, which FLOPs per token, MFU and parallama-plan read, is not the
    built model's (a block changed without its config's `block_params`); `shape`: a parameter's logical shape."""
    built, counted = sum(math.prod(shape(p)) for p in model.parameters()), model.config.num_params()
    if built == counted:
        return None
    return (
        f"model.family={family}: {type(model.config).__name__}.num_params() counts {counted:,} parameters but "
        f"{type(model).__name__} has {built:,}, so FLOPs per token, MFU and parallama-plan are off by that much: "
        "a block whose parameters change overrides its config's block_params (docs/architecture.md)"
    )


def check_config(config, family: str) -> None:
    """`config` offers what `ModelConfig` declares, or one line naming what it lacks."""
    if missing := _missing(config, ModelConfig):
        raise ConfigError(
            f"model.family={family}: {type(config).__name__} lacks {', '.join(missing)} of the config contract "
            "(parallama.models.contract.ModelConfig)"
        )


def load_state_into(model: nn.Module, state_dict: dict[str, Tensor], source: str = "checkpoint") -> None:
    """load_state_dict with a one-line error naming the first key that does not fit `model`."""
    expected = model.state_dict()
    for key, tensor in expected.items():
        if key not in state_dict:
            raise ConfigError(f"{source} has no {key}; it is not from this model (architecture differs)")
        if state_dict[key].shape != tensor.shape:
            raise ConfigError(
                f"{source} has {key} of shape {tuple(state_dict[key].shape)} but the model expects "
                f"{tuple(tensor.shape)}; set model.* to the checkpoint's shape"
            )
    if extra := sorted(set(state_dict) - set(expected)):
        raise ConfigError(f"{source} has {extra[0]}, which the model does not have (architecture differs)")
    model.load_state_dict(state_dict)
