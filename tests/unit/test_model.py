import math

import pytest
import torch

from parallama.models.generation import generate
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import (
    Llama,
    apply_rotary,
    rope_inv_freq,
)

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaConfig(**{**kwargs, **overrides})


def build(seed=0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama(tiny(**overrides)).eval()


def tokens(*shape, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, shape, generator=g)


# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            dict(hidden_size=100, num_attention_heads=12),
            r"model\.num_attention_heads=12 must divide model\.hidden_size=100",
        ),
        (
            dict(num_attention_heads=4, num_key_value_heads=3),
            r"model\.num_key_value_heads=3 must divide model\.num_attention_heads=4",
        ),
        (dict(vocab_size=0), r"model\.vocab_size=0"),
        (dict(hidden_size=-64), r"model\.hidden_size=-64"),
        (dict(intermediate_size=0), r"model\.intermediate_size"),
        (dict(num_hidden_layers=0), r"model\.num_hidden_layers"),
        (dict(num_attention_heads=0), r"model\.num_attention_heads"),
        (dict(num_key_value_heads=0), r"model\.num_key_value_heads"),
        (dict(max_position_embeddings=0), r"model\.max_position_embeddings"),
        (dict(rms_norm_eps=0.0), r"model\.rms_norm_eps"),
        (dict(rope_theta=-1.0), r"model\.rope_theta"),
        (dict(initializer_range=0.0), r"model\.initializer_range"),
        (dict(hidden_size=60, num_attention_heads=4), r"must be even"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), r"model\.rope_scaling\.rope_type='yarn'"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 2.0}), r"model\.rope_scaling is missing"),
    ],
)
def test_config_validation_names_the_key(overrides, match):
    with pytest.raises(ValueError, match=match) as info:
        tiny(**overrides)
    assert "\n" not in str(info.value)


def test_config_defaults_and_head_dim():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4)
    assert cfg.num_key_value_heads == 4
    assert cfg.head_dim == 16


@pytest.mark.parametrize("overrides", [{}, {"rope_scaling": LLAMA3_SCALING, "tie_word_embeddings": True}])
def test_hf_dict_round_trip(overrides):
    transformers = pytest.importorskip("transformers")
    cfg = tiny(**overrides)
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["LlamaForCausalLM"] and d["model_type"] == "llama"
    assert d["head_dim"] == 16 and d["hidden_act"] == "silu"
    assert "bos_token_id" not in d and "eos_token_id" not in d
    assert LlamaConfig.from_hf_dict({**d, "unknown_key": 1}) == cfg
    # and through transformers' own (v5: rope_parameters) serialization
    assert LlamaConfig.from_hf_dict(transformers.LlamaConfig(**d).to_dict()) == cfg


# --- shapes, counts, flops ----------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_shapes_and_num_params(tie):
    model = build(tie_word_embeddings=tie)
    logits = model(tokens(3, 10))
    assert logits.shape == (3, 10, 97) and logits.dtype == torch.float32
    cfg = model.config
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    if tie:
        assert model.lm_head.weight is model.embed_tokens.weight
        assert cfg.num_params(non_embedding=True) == cfg.num_params()
    else:
        assert cfg.num_params(non_embedding=True) == cfg.num_params() - 97 * 64


def test_flops_per_token_by_hand():
    cfg = tiny()
    # per layer: q 64*64 + k,v 2*64*32 + o 64*64 + mlp 3*64*96 + norms 2*64
    layer = 4096 + 4096 + 4096 + 18432 + 128
    n = 2 * layer + 64 + 97 * 64  # layers + final norm + lm_head (embedding excluded)
    assert cfg.num_params(non_embedding=True) == n == 67_968
    assert cfg.flops_per_token(seq_len=16) == 6 * n + 12 * 2 * 4 * 16 * 16


def test_bf16_logits_dtype():
    model = build().to(torch.bfloat16)
    assert model(tokens(1, 5)).dtype == torch.bfloat16


# --- attention ----------------------------------------------------------------------------


def test_causality():
    model = build()
    x = tokens(2, 12)
    t = 7
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % 97
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert (a[:, t] - b[:, t]).abs().max() > 1e-4


def reference_attention(attn, x, cos, sin):
    """Textbook attention with K/V heads explicitly repeated, as HF's repeat_kv does."""
    B, T, _ = x.shape
    hd = attn.head_dim
    q = attn.q_proj(x).view(B, T, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, -1, hd).transpose(1, 2)
    v = attn.v_proj(x).view(B, T, -1, hd).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    return attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_gqa_matches_repeat_interleave_reference(kv_heads):
    model = build(num_key_value_heads=kv_heads)
    assert model(tokens(2, 9)).isfinite().all()
    torch.manual_seed(2)
    x = torch.randn(2, 9, 64)
    attn, rope = model.layers["0"].self_attn, model.rotary_emb
    cos, sin = rope.cos[:9], rope.sin[:9]
    with torch.no_grad():
        torch.testing.assert_close(
            attn(x, cos, sin), reference_attention(attn, x, cos, sin), atol=1e-6, rtol=1e-5
        )


def test_right_padding_matches_unpadded():
    model = build()
    a, b = tokens(1, 11, seed=3), tokens(1, 6, seed=4)
    batch = torch.zeros(2, 11, dtype=torch.long)
    batch[0], batch[1, :6] = a[0], b[0]
    mask = torch.zeros(2, 11, dtype=torch.long)
    mask[0], mask[1, :6] = 1, 1
    with torch.no_grad():
        padded = model(batch, attention_mask=mask)
        torch.testing.assert_close(padded[0], model(a)[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(padded[1, :6], model(b)[0], atol=1e-5, rtol=0)


def test_left_padding_has_no_nan_in_forward_or_backward():
    torch.manual_seed(0)
    model = Llama(tiny())
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    logits = model(tokens(2, 6), attention_mask=mask)
    assert logits.isfinite().all()
    logits.sum().backward()
    assert all(p.grad.isfinite().all() for p in model.parameters())


# --- Hugging Face parity ------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"rope_scaling": LLAMA3_SCALING},
        {"tie_word_embeddings": True, "num_key_value_heads": 1},
    ],
)
def test_matches_hf_llama(overrides):
    transformers = pytest.importorskip("transformers")
    cfg = tiny(**overrides)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**cfg.to_hf_dict(), attn_implementation="sdpa")
    ).eval()
    ours = Llama(cfg).eval()
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    x = tokens(2, 48)  # longer than original_max_position_embeddings of the llama3 case
    mask = torch.ones_like(x)
    mask[1, 30:] = 0
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, atol=1e-5, rtol=0)
        ref = hf(x, attention_mask=mask).logits
        got = ours(x, attention_mask=mask)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, :30], ref[1, :30], atol=1e-5, rtol=0)


def test_llama3_inv_freq_is_bit_identical_to_hf():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = tiny(rope_scaling=LLAMA3_SCALING, hidden_size=256, num_attention_heads=2)
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf_dict())
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, device=torch.device("cpu"))
    assert torch.equal(rope_inv_freq(cfg), expected)
    assert not torch.equal(rope_inv_freq(cfg), rope_inv_freq(tiny(hidden_size=256, num_attention_heads=2)))


# --- meta-device init ---------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_meta_device_init(tie):
    reference = build(tie_word_embeddings=tie)
    with torch.device("meta"):
        model = Llama(tiny(tie_word_embeddings=tie))
    assert model.rotary_emb.cos.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert torch.equal(model.rotary_emb.cos, reference.rotary_emb.cos)
    assert torch.equal(model.rotary_emb.sin, reference.rotary_emb.sin)
    assert (model.lm_head.weight is model.embed_tokens.weight) == tie
    assert model.config.num_params() == sum(p.numel() for p in model.parameters())
    assert torch.equal(model.norm.weight, torch.ones(64))
    assert model(tokens(2, 8)).isfinite().all()
    # residual projections are scaled down by sqrt(2 * num_layers)
    std = model.layers["0"].mlp.down_proj.weight.std().item()
    assert 0.02 / 2 * 0.7 < std < 0.02 / 2 * 1.3


# --- KV cache and generation --------------------------------------------------------------


def test_kv_cache_prefill_and_decode_match_full_forward():
    model = build()
    x = tokens(2, 12)
    with torch.no_grad():
        full = model(x)
        cache = model.new_kv_cache(batch_size=2, max_len=16)
        chunks = [
            model(x[:, :4], input_pos=torch.arange(4), kv_cache=cache),  # prefill
            model(x[:, 4:7], input_pos=torch.arange(4, 7), kv_cache=cache),
        ]  # chunked prefill
        for t in range(7, 12):  # single-token decode
            chunks.append(model(x[:, t : t + 1], input_pos=torch.tensor([t]), kv_cache=cache))
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=0)


def test_kv_cache_requires_input_pos():
    model = build()
    with pytest.raises(ValueError, match="input_pos"):
        model(tokens(1, 3), kv_cache=model.new_kv_cache(1, 8))


def naive_greedy(model, x, n):
    for _ in range(n):
        x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x


def test_generate_greedy_matches_naive_loop():
    model = build()
    x = tokens(2, 5)
    with torch.no_grad():
        expected = naive_greedy(model, x, 10)
    assert torch.equal(generate(model, x, 10, temperature=0), expected)
    assert torch.equal(generate(model, x, 10, top_k=1), expected)
    assert torch.equal(generate(model, x, 10, top_p=1e-6), expected)


def test_generate_stops_at_eos():
    model = build()
    x = tokens(2, 5)
    with torch.no_grad():
        greedy = naive_greedy(model, x, 12)[:, 5:]
    eos = int(greedy[0, 2])
    # each row follows greedy up to its first eos, then repeats eos; stop when all rows are done
    firsts = [(row == eos).nonzero()[0].item() if (row == eos).any() else None for row in greedy]
    stop = 12 if None in firsts else max(firsts) + 1
    expected = greedy[:, :stop].clone()
    for i, first in enumerate(firsts):
        if first is not None:
            expected[i, first:] = eos
    out = generate(model, x, 12, temperature=0, eos_id=eos)
    assert torch.equal(out, torch.cat([x, expected], dim=1))
    single = generate(model, x[:1], 12, temperature=0, eos_id=eos)
    assert single.shape == (1, 5 + firsts[0] + 1) and single[0, -1] == eos


def test_generate_sampling_is_seeded_and_in_vocab():
    model = build()
    x = tokens(2, 4)
    a = generate(
        model, x, 8, temperature=0.8, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(5)
    )
    b = generate(
        model, x, 8, temperature=0.8, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(a, b) and a.shape == (2, 12)
    assert torch.equal(a[:, :4], x) and a.min() >= 0 and a.max() < 97


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=60), "max_new_tokens"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
    ],
)
def test_generate_rejects_bad_args(kwargs, match):
    model = build()
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, tokens(1, 5), **kwargs)
