"""`loss.impl=fused` (training/loss.py, training/fused_cross_entropy.py): the head's matmul and the cross-entropy per
chunk of tokens give the plain loss's value and gradients (fp32, 1e-5), with label smoothing, z-loss, ignored labels,
tied embeddings and a padded vocabulary, on both of its paths (parallama's, its gradients computed in the forward
pass, and the checkpointed chunks), without keeping the logits; validation is plain. Every parallel layout:
tests/distributed/test_fused_loss_parity.py."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch._inductor.graph import GraphLowering

from parallama import CONF_DIR
from parallama.app.compose import preflight
from parallama.errors import ConfigError
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.tokenizer import IGNORE_INDEX
from parallama.training import fused_cross_entropy, loss
from parallama.training.loss import CrossEntropy
from parallama.training.module import CausalLM

VOCAB = 300


def llama(tied: bool = False) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return Llama(config)


@pytest.fixture(scope="module")
def model() -> Llama:
    return llama()


def batch(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20), generator=generator)
    labels = torch.randint(0, vocab, (3, 20), generator=generator)
    labels[0, :5] = labels[2, -3:] = IGNORE_INDEX
    return ids, labels


def loss_and_grads(model: Llama, loss_fn: CrossEntropy) -> tuple[torch.Tensor, dict]:
    model = copy.deepcopy(model)
    ids, labels = batch()
    if loss_fn.fuses():
        loss = model.head(model(ids, hidden_states=True), loss_fn.head_loss(labels))
    else:
        loss = loss_fn(model(ids), labels)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def paths_taken(monkeypatch) -> list[str]:
    """The paths `CrossEntropy.fused` runs from now on (parallama's Function, or checkpointed chunks)."""
    taken = []
    apply, chunk_loss = fused_cross_entropy.LinearCrossEntropy.apply, CrossEntropy._chunk_loss

    def spy_apply(*args):
        taken.append("parallama")
        return apply(*args)

    def spy_chunk_loss(self, *args):
        taken.append("checkpointed")
        return chunk_loss(self, *args)

    monkeypatch.setattr(fused_cross_entropy.LinearCrossEntropy, "apply", spy_apply)
    monkeypatch.setattr(CrossEntropy, "_chunk_loss", spy_chunk_loss)
    return taken


def take_checkpointed(monkeypatch) -> None:
    monkeypatch.setattr(loss, "fused_path", lambda loss_fn, head: "checkpointed")


def assert_same(loss, grads, plain_loss, plain_grads) -> None:
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


CASES = [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2), (0.1, 1e-2)]


@pytest.mark.parametrize("path", ["parallama", "checkpointed"])
@pytest.mark.parametrize("smoothing, z_loss", CASES)
def test_fused_equals_plain_in_loss_and_gradients(model, monkeypatch, path, smoothing, z_loss):
    if path == "checkpointed":
        take_checkpointed(monkeypatch)
    plain_loss, plain_grads = loss_and_grads(model, CrossEntropy(smoothing, z_loss))
    taken = paths_taken(monkeypatch)
    fused = CrossEntropy(smoothing, z_loss, impl="fused", chunk_size=7)  # 60 tokens: 9 chunks, the last short
    loss, grads = loss_and_grads(model, fused)
    # one call of the Function; or each chunk's logits in forward, then again in backward
    assert set(taken) == {path} and len(taken) == (1 if path == "parallama" else 2 * 9)
    assert_same(loss, grads, plain_loss, plain_grads)


def test_tied_embeddings_get_both_gradients():
    """Llama-3.2-1B ties its head to the embedding: the table's gradient is the sum of both uses."""
    tied = llama(tied=True)
    plain_loss, plain_grads = loss_and_grads(tied, CrossEntropy(0.1, 1e-2))
    loss, grads = loss_and_grads(tied, CrossEntropy(0.1, 1e-2, impl="fused", chunk_size=16))
    assert "lm_head.weight" not in grads  # one parameter
    assert_same(loss, grads, plain_loss, plain_grads)


@pytest.mark.parametrize("path", ["parallama", "checkpointed"])
def test_rows_past_the_valid_vocabulary_take_no_probability(model, monkeypatch, path):
    """A head padded past the true vocabulary (`valid_vocab`): the loss and gradients of the true rows' logits
    alone; the padded rows' gradient is zero."""
    if path == "checkpointed":
        take_checkpointed(monkeypatch)
    valid = VOCAB - 44
    ids, labels = batch(vocab=valid)
    hidden = model(ids, hidden_states=True).detach().requires_grad_()
    head = copy.deepcopy(model.lm_head)
    plain = CrossEntropy(0.1, 1e-2)(head(hidden)[..., :valid], labels)
    want = torch.autograd.grad(plain, [hidden, head.weight])
    fused = CrossEntropy(0.1, 1e-2, impl="fused", chunk_size=7)
    got_loss = fused.fused(hidden, head, labels, valid_vocab=valid)
    got = torch.autograd.grad(got_loss, [hidden, head.weight])
    torch.testing.assert_close(got_loss, plain, rtol=1e-6, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert got[1][valid:].abs().max() == 0


def saved_logits(model: Llama, loss_fn: CrossEntropy) -> int:
    """The most elements of any tensor shaped like logits (..., vocab) that autograd keeps for backward."""
    sizes = [0]

    def pack(t):
        if t.shape and t.shape[-1] == VOCAB:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_and_grads(model, loss_fn)
    return max(sizes)


@pytest.mark.parametrize("path", ["parallama", "checkpointed"])
def test_fused_keeps_no_logits_for_backward(model, monkeypatch, path):
    if path == "checkpointed":
        take_checkpointed(monkeypatch)
    assert saved_logits(model, CrossEntropy()) >= 3 * 20 * VOCAB  # the plain loss keeps them
    assert saved_logits(model, CrossEntropy(impl="fused", chunk_size=7)) == 0


def test_the_weight_gradient_comes_back_in_the_parameters_dtype():
    """Under autocast the chunks compute in bf16 against the fp32 master weight, whose gradient is accumulated in
    fp32 and comes back fp32; a bf16 weight (FSDP2's bf16 mixed precision: no autocast) gets a bf16 gradient. Both
    near the fp32 loss's (bf16's precision)."""
    torch.manual_seed(0)
    hidden = torch.randn(50, 64, requires_grad=True)
    weight = (0.1 * torch.randn(VOCAB, 64)).requires_grad_()
    _, labels = batch()
    labels = labels.flatten()[:50]
    exact = torch.autograd.grad(CrossEntropy(0.1, 1e-2)(hidden @ weight.T, labels), [hidden, weight])
    fused = CrossEntropy(0.1, 1e-2, impl="fused", chunk_size=16)
    head = torch.nn.Linear(64, VOCAB, bias=False)
    head.weight = torch.nn.Parameter(weight.detach().clone())
    with torch.autocast("cpu", torch.bfloat16):
        under_autocast = torch.autograd.grad(fused.fused(hidden, head, labels), [hidden, head.weight])
    head.weight = torch.nn.Parameter(weight.detach().bfloat16())
    hidden_bf16 = hidden.detach().bfloat16().requires_grad_()
    bf16 = torch.autograd.grad(fused.fused(hidden_bf16, head, labels), [hidden_bf16, head.weight])
    assert [g.dtype for g in under_autocast] == [torch.float32, torch.float32]
    assert [g.dtype for g in bf16] == [torch.bfloat16, torch.bfloat16]
    for grads in (under_autocast, bf16):
        for g, e in zip(grads, exact):
            torch.testing.assert_close(g.float(), e, rtol=0.05, atol=2e-4)


def test_the_compiled_chunk_step_equals_the_eager_one():
    """On CUDA each chunk's elementwise pass is compiled (`compiled_chunk_loss_and_grad_`): compiled here on CPU,
    once for the chunk length and once more, with the length dynamic, for a shorter last chunk, it gives the eager
    loss and gradient of bf16 logits (autocast's), with label smoothing, z-loss, masked columns and ignored labels,
    and it allocates nothing the size of the chunk: the gradient is written into the logits, with no fp32 copy of
    them on the way (the scattered target's term and the kept exponentials had made inductor hold two)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # this process may have compiled other graphs before
    torch.manual_seed(0)
    codes = []  # the compiled graphs' code
    for tokens in (40, 13, 7):  # a chunk, then a batch's last, shorter ones
        labels = torch.randint(0, 250, (tokens,))
        labels[:3] = IGNORE_INDEX
        logits = (3 * torch.randn(tokens, VOCAB)).bfloat16()
        eager_grad, compiled_grad = logits.clone(), logits.clone()
        eager = fused_cross_entropy.chunk_loss_and_grad_(eager_grad, labels, 0.1, 1e-2, 250)
        with mock.patch.object(GraphLowering, "save_output_code", codes.append):  # inductor's own hook
            compiled = fused_cross_entropy.compiled_chunk_loss_and_grad_(
                compiled_grad, labels, 0.1, 1e-2, 250
            )
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5, atol=1e-7)
        assert eager_grad[:, 250:].abs().max() == 0 and eager_grad[:3].abs().max() == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # not one per length
    assert len(codes) == 2
    assert [
        line
        for code in codes
        for line in code.splitlines()
        if "empty_strided" in line and f", {VOCAB})" in line
    ] == []


def tiny_module(loss: dict) -> CausalLM:
    model = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    optimizer = dict(_target_="torch.optim.AdamW", lr=1e-3)
    scheduler = dict(_target_="parallama.training.schedules.Constant")
    torch.manual_seed(0)
    module = CausalLM(model=model, optimizer=optimizer, scheduler=scheduler, loss=loss)
    module.configure_model()
    return module


def test_validation_takes_the_plain_path_and_its_logits_reach_the_hook():
    """CausalLM.on_validation_logits's promise under loss.impl=fused: validation (no gradients) computes the
    logits and hands them to the hook; a training step does not compute them."""
    target = "parallama.training.loss.CrossEntropy"
    fused, plain = tiny_module({"_target_": target, "impl": "fused"}), tiny_module({"_target_": target})
    seen = []
    fused.on_validation_logits = lambda logits, labels: seen.append(logits.shape)
    ids = torch.randint(0, 64, (2, 8))
    data = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    torch.testing.assert_close(fused.loss(data), plain.loss(data))
    assert seen == []
    with torch.no_grad():
        torch.testing.assert_close(fused.loss(data), plain.loss(data))
    assert seen == [torch.Size([2, 8, 64])]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.impl=liger"], r"^loss.impl='liger' is not valid; use one of plain, fused$"),
        (["loss.chunk_size=0"], r"^loss.chunk_size=0 is not valid; use a number of tokens >= 1$"),
    ],
)
def test_a_bad_loss_impl_is_one_line_before_work(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        preflight(CONF_DIR, "train", ["trainer.accelerator=cpu", *overrides])
    assert "\n" not in str(err.value)


def test_the_fused_loss_passes_the_checks():
    preflight(CONF_DIR, "train", ["trainer.accelerator=cpu", "loss.impl=fused", "loss.z_loss=1e-4"])


def test_a_subclass_term_runs_on_each_chunk_under_fused(model, monkeypatch):
    """A loss term of the user's own (docs/customize.md) is a `__call__` override: its gradient cannot be computed
    ahead, so fused computes it on each chunk's logits (reduction="sum"), the checkpointed path."""

    class WithLogitPenalty(CrossEntropy):
        def __call__(self, logits, labels, reduction="mean"):
            loss = super().__call__(logits, labels, reduction)
            term = torch.where(
                labels.flatten() != IGNORE_INDEX, logits.flatten(0, -2).square().mean(-1), 0
            ).sum()
            return loss + 1e-2 * (term if reduction == "sum" else term / (labels != IGNORE_INDEX).sum())

    plain_loss, plain_grads = loss_and_grads(model, WithLogitPenalty())
    taken = paths_taken(monkeypatch)
    loss, grads = loss_and_grads(model, WithLogitPenalty(impl="fused", chunk_size=7))
    assert set(taken) == {"checkpointed"}
    assert not torch.allclose(plain_loss, loss_and_grads(model, CrossEntropy())[0])
    assert_same(loss, grads, plain_loss, plain_grads)


@pytest.mark.parametrize("path", ["parallama", "checkpointed"])
def test_backward_twice_as_a_zero_bubble_schedule_runs_it(model, monkeypatch, path):
    """A zero-bubble pipeline schedule takes the input gradients first (retaining the graph) and the weight
    gradients later, two passes through the loss: both give the plain loss's."""
    if path == "checkpointed":
        take_checkpointed(monkeypatch)
    head = copy.deepcopy(model.lm_head)
    ids, labels = batch()
    hidden = model(ids, hidden_states=True).detach().requires_grad_()
    plain = CrossEntropy(0.1, 1e-2)(head(hidden), labels)
    want = torch.autograd.grad(plain, [hidden, head.weight])
    loss = CrossEntropy(0.1, 1e-2, impl="fused", chunk_size=7).fused(hidden, head, labels)
    got = [torch.autograd.grad(loss, hidden, retain_graph=True)[0], torch.autograd.grad(loss, head.weight)[0]]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
