"""One attention pattern for every path: a sliding window written once, as `Attention.mask_mod` in a family of the
test's own (this module is the family: `model.family=test_attention_pattern`), is what training's forward, padded
and packed batches, the KV cache's prefill and decode steps and generation compute; context parallel, whose ring
attention is plain causal, refuses it in one line before any rank starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from parallama import CONF_DIR
from parallama.app.compose import preflight
from parallama.errors import ConfigError
from parallama.models import ModelSpec
from parallama.models.generation import generate
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Attention, DecoderLayer, Llama


@dataclasses.dataclass
class SlidingConfig(LlamaConfig):
    sliding_window: int = 8


class SlidingWindowAttention(Attention):
    """Each query sees itself and the `sliding_window` - 1 positions before it."""

    def __init__(self, config):
        super().__init__(config)
        self.window = config.sliding_window

    def mask_mod(self, b, h, q_idx, kv_idx):
        return super().mask_mod(b, h, q_idx, kv_idx) & (q_idx - kv_idx < self.window)


class SlidingLayer(DecoderLayer):
    attention = SlidingWindowAttention


class SlidingLlama(Llama):
    decoder_layer = SlidingLayer


SPEC = ModelSpec(
    family=__name__,
    config=SlidingConfig,
    model_path=f"{__name__}.SlidingLlama",
    parallelize_path="parallama.models.llama.parallelize.parallelize",
)
SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def sliding_model(seed=0) -> SlidingLlama:
    torch.manual_seed(seed)
    return SlidingLlama(SlidingConfig(**SHAPE, sliding_window=8)).eval()


def reference_logits(model, ids):
    """The window by hand: each layer's attention with SDPA and an explicit banded mask."""
    T = ids.shape[1]
    pos = torch.arange(T)
    band = (pos[:, None] >= pos[None]) & (pos[:, None] - pos[None] < model.config.sliding_window)
    h = model.embed_tokens(ids)
    cos, sin = model.rotary_emb.cos[:T], model.rotary_emb.sin[:T]
    from parallama.models.llama.model import apply_rotary

    for layer in model.layers.values():
        attn = layer.self_attn
        q, k, v = (t.transpose(1, 2) for t in attn.project(layer.input_layernorm(h)))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, band, enable_gqa=True)
        h = h + attn.o_proj(y.transpose(1, 2).reshape(*ids.shape, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.norm(h))


@torch.no_grad()
def test_the_training_forward_takes_the_window():
    model = sliding_model()
    ids = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    torch.testing.assert_close(logits, reference_logits(model, ids), atol=1e-5, rtol=0)
    plain = Llama(LlamaConfig(**SHAPE)).eval()
    plain.load_state_dict(model.state_dict())
    # the window changes nothing inside it, everything after it
    torch.testing.assert_close(plain(ids)[:, :8], logits[:, :8], atol=1e-5, rtol=0)
    assert (plain(ids)[:, 8:] - logits[:, 8:]).abs().amax() > 1e-2
    # right padding and packed documents: the window inside what they allow
    real = torch.ones_like(ids)
    torch.testing.assert_close(model(ids, real), logits, atol=1e-5, rtol=0)
    one_document = torch.zeros_like(ids)
    torch.testing.assert_close(model(ids, document_ids=one_document), logits, atol=1e-5, rtol=0)


@torch.no_grad()
def test_kv_cache_prefill_decode_and_generation_equal_the_training_forward():
    """The cache's slot mask comes from the same mask_mod: logits after the window match the full forward."""
    model = sliding_model()
    ids = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(2))
    full = model(ids)
    cache = model.new_kv_cache(2, 30)
    prefill = model(ids[:, :12], input_pos=torch.arange(12), kv_cache=cache)
    steps = [model(ids[:, i : i + 1], input_pos=torch.tensor([i]), kv_cache=cache) for i in range(12, 30)]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=1e-5, rtol=0)
    # greedy generation: each new token is the training forward's argmax over the sequence so far
    out = generate(model, ids[:, :4], max_new_tokens=20, temperature=0)
    torch.testing.assert_close(model(out[:, :-1])[:, 3:].argmax(-1), out[:, 4:], atol=0, rtol=0)


def test_the_plain_pattern_keeps_sdpas_fast_path():
    assert Llama(LlamaConfig(**SHAPE)).layers["0"].self_attn.is_causal
    assert not sliding_model().layers["0"].self_attn.is_causal


CP = ["strategy=model_parallel", "trainer.accelerator=cpu", "trainer.devices=2", "strategy.cp=2"]
FAMILY = [
    f"model.family={__name__}",
    "+model.sliding_window=8",
    "data.seq_len=64",
    "model.max_position_embeddings=64",
]


def test_context_parallel_refuses_the_window_in_one_line_before_the_ranks_start():
    with pytest.raises(ConfigError) as err:
        preflight(CONF_DIR, "train", [*CP, *FAMILY])
    line = str(err.value)
    assert line == (
        "strategy.cp=2 runs torch's causal ring attention, which has no place for SlidingWindowAttention's own "
        "pattern (SlidingWindowAttention.mask_mod); use strategy.cp=1"
    )
    preflight(CONF_DIR, "train", [*CP, "data.seq_len=64"])  # the Llama's plain causal pattern runs there
    preflight(
        CONF_DIR,
        "train",
        [*FAMILY, "strategy=model_parallel", "trainer.accelerator=cpu", "trainer.devices=2"],
    )
