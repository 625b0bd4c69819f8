"""The head's vocabulary padded to a multiple of `model.pad_vocab_multiple` inside the computation (models/llama
`Llama.logits`): a vocabulary of 300 padded to 320 gives the unpadded model's logits (exactly 300 of them),
gradients, KV-cache steps and generations (fp32, 1e-6), with and without tied embeddings, for every family; its
parameters, parameter count and Hugging Face config are the unpadded model's. Hugging Face folders:
tests/integration/test_export.py; an old checkpoint: tests/integration/test_legacy_checkpoints.py; tensor parallel
and FSDP: tests/distributed/test_vocab_padding_parity.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from parallama.models import model_spec
from parallama.models.generation import generate
from parallama.tokenizer import IGNORE_INDEX
from parallama.training.loss import CrossEntropy

VOCAB = 300  # padded to 320
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    "llama": {},
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
}


def build(family="llama", tie=False, pad=64, vocab=VOCAB):
    spec = model_spec({"family": family})
    fields = {**SHAPE, **FAMILIES[family], "vocab_size": vocab, "tie_word_embeddings": tie}
    torch.manual_seed(0)
    return spec.model(spec.build_config({**fields, "pad_vocab_multiple": pad}))


def pair(family="llama", tie=False):
    """The padded model and its unpadded copy: the same weights."""
    padded = build(family, tie)
    unpadded = copy.deepcopy(padded)
    unpadded.config.pad_vocab_multiple = 1
    return padded, unpadded


def ids_and_labels():
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, VOCAB, (3, 20), generator=g), torch.randint(0, VOCAB, (3, 20), generator=g)
    labels[0, :4] = IGNORE_INDEX
    return ids, labels


@pytest.fixture
def head_widths(monkeypatch) -> list[int]:
    """The output width of every matmul of the vocabulary's size or more (the head's, padded or not)."""
    widths, linear = [], F.linear

    def spy(x, weight, *args, **kwargs):
        if weight.shape[0] >= VOCAB:
            widths.append(weight.shape[0])
        return linear(x, weight, *args, **kwargs)

    monkeypatch.setattr(F, "linear", spy)
    return widths


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_padded_head_gives_the_true_logits_and_gradients(family, tie, head_widths):
    padded, unpadded = pair(family, tie)
    ids, labels = ids_and_labels()
    out = {}
    for name, model in (("padded", padded), ("unpadded", unpadded)):
        logits = model(ids)
        loss = CrossEntropy(label_smoothing=0.1, z_loss=1e-3)(logits, labels)
        loss.backward()
        out[name] = logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert head_widths == [320, VOCAB]  # the padded model's matmul was padded, the other's not
    (logits, loss, grads), (want_logits, want_loss, want_grads) = out["padded"], out["unpadded"]
    assert logits.shape == (3, 20, VOCAB)
    torch.testing.assert_close(logits, want_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_kv_cache_steps_and_generation_match_the_unpadded_model(head_widths):
    padded, unpadded = pair()
    ids, _ = ids_and_labels()

    def cached_steps(model):  # with gradients on: the padded path, step by step through the cache
        cache = model.new_kv_cache(batch_size=3, max_len=20)
        steps = [model(ids[:, :8], input_pos=torch.arange(8), kv_cache=cache)]
        steps += [model(ids[:, t : t + 1], input_pos=torch.tensor([t]), kv_cache=cache) for t in range(8, 20)]
        return torch.cat(steps, dim=1).detach()

    steps = cached_steps(padded)
    assert set(head_widths) == {320}
    torch.testing.assert_close(steps, cached_steps(unpadded), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(steps, padded(ids).detach(), rtol=1e-5, atol=1e-5)
    for kwargs in (dict(temperature=0), dict(temperature=1.0, top_k=50, top_p=0.95)):
        out = [
            generate(m, ids[:, :5], 12, generator=torch.Generator().manual_seed(3), **kwargs) for m in pair()
        ]
        assert torch.equal(out[0], out[1]) and out[0].max() < VOCAB


def test_padding_runs_only_where_it_pays(head_widths):
    """Not without gradients (the copy would cost more than it saves), not for a vocabulary that is already a
    multiple, not with pad_vocab_multiple=1."""
    ids, _ = ids_and_labels()
    with torch.no_grad():
        build()(ids)
    build(vocab=320)(ids)
    build(pad=1)(ids)
    assert head_widths == [VOCAB, 320, VOCAB]


def test_padded_head_under_autocast_gives_the_unpadded_logits():
    """Autocast: the weight is padded in the compute dtype, as the unpadded matmul casts it."""
    padded, unpadded = pair()
    ids, _ = ids_and_labels()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, want = padded(ids), unpadded(ids)
    assert logits.dtype == want.dtype == torch.bfloat16 and logits.shape == want.shape
    torch.testing.assert_close(logits, want, rtol=1e-2, atol=1e-2)


def test_parameters_count_and_hf_config_keep_the_true_vocabulary():
    model = build()
    assert model.lm_head.weight.shape == model.embed_tokens.weight.shape == (VOCAB, 64)
    assert model.state_dict().keys() == build(pad=1).state_dict().keys()
    assert model.config.num_params() == sum(p.numel() for p in model.parameters())
    hf = model.config.to_hf_dict()
    assert hf["vocab_size"] == VOCAB and "pad_vocab_multiple" not in hf
    assert type(model.config).from_hf_dict(hf).pad_vocab_multiple == 1  # parallama's default: off


@pytest.mark.parametrize("value", [0, -64, 1.5, "64"])
def test_a_bad_multiple_is_one_line_naming_the_key(value):
    with pytest.raises(ValueError, match=rf"^model\.pad_vocab_multiple={value!r} must be a positive int$"):
        build(pad=value)
