"""`loss.impl=fused` (training/loss.py): the head's matmul and the cross-entropy per chunk of tokens give the plain
loss's value and gradients (fp32), with label smoothing, z-loss and ignored labels, on both of its paths (torch's
`F.linear_cross_entropy`, and the checkpointed chunks), without keeping the whole logits; validation is plain.
Every parallel layout: tests/distributed/test_fused_loss_parity.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from parallama import CONF_DIR
from parallama.config.compose import preflight
from parallama.data.datasets import IGNORE_INDEX
from parallama.errors import ConfigError
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.training.loss import CrossEntropy
from parallama.training.module import CausalLM

VOCAB = 300


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Llama(config)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20), generator=generator)
    labels = torch.randint(0, VOCAB, (3, 20), generator=generator)
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


def used_torch_op(monkeypatch) -> list:
    calls = []
    op = F.linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs["options"])
        return op(*args, **kwargs)

    monkeypatch.setattr(F, "linear_cross_entropy", spy)
    return calls


# torch's op has no z-loss, and with label smoothing it computes the whole logits: those take the chunked path
CASES = [("torch", 0.0, 0.0), ("chunked", 0.0, 0.0), ("chunked", 0.1, 0.0), ("chunked", 0.0, 1e-2)]
CASES += [("chunked", 0.1, 1e-2)]


@pytest.mark.parametrize("path, smoothing, z_loss", CASES)
def test_fused_equals_plain_in_loss_and_gradients(model, monkeypatch, path, smoothing, z_loss):
    if path == "chunked" and not (smoothing or z_loss):
        monkeypatch.setattr(CrossEntropy, "_torch_fuses", lambda self, head: False)
    calls = used_torch_op(monkeypatch)
    plain_loss, plain_grads = loss_and_grads(model, CrossEntropy(smoothing, z_loss))
    fused = CrossEntropy(smoothing, z_loss, impl="fused", chunk_size=7)  # 60 tokens: 9 chunks, the last short
    loss, grads = loss_and_grads(model, fused)
    assert len(calls) == (path == "torch") and (not calls or calls[0].batch_chunk_size == 7)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def largest_saved_tensor(model: Llama, loss_fn: CrossEntropy) -> int:
    """The most elements of any tensor autograd keeps for backward in a training forward pass."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_and_grads(model, loss_fn)
    return max(sizes)


@pytest.mark.parametrize("path", ["torch", "chunked"])
def test_fused_keeps_no_logits_for_backward(model, monkeypatch, path):
    if path == "chunked":
        monkeypatch.setattr(CrossEntropy, "_torch_fuses", lambda self, head: False)
    logits = 3 * 20 * VOCAB
    assert largest_saved_tensor(model, CrossEntropy()) >= logits  # the plain loss keeps them
    assert largest_saved_tensor(model, CrossEntropy(impl="fused", chunk_size=7)) < logits / 2


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


def test_a_subclass_term_runs_on_each_chunk_under_fused(model):
    """A loss term of the user's own (docs/customize.md) is a `__call__` override: fused computes it on each
    chunk's logits (reduction="sum"), never torch's op, which knows only cross-entropy."""

    class WithLogitPenalty(CrossEntropy):
        def __call__(self, logits, labels, reduction="mean"):
            loss = super().__call__(logits, labels, reduction)
            term = torch.where(
                labels.flatten() != IGNORE_INDEX, logits.flatten(0, -2).square().mean(-1), 0
            ).sum()
            return loss + 1e-2 * (term if reduction == "sum" else term / (labels != IGNORE_INDEX).sum())

    plain_loss, plain_grads = loss_and_grads(model, WithLogitPenalty())
    loss, grads = loss_and_grads(model, WithLogitPenalty(impl="fused", chunk_size=7))
    assert not torch.allclose(plain_loss, loss_and_grads(model, CrossEntropy())[0])
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_backward_twice_as_a_zero_bubble_schedule_runs_it(model):
    """A zero-bubble pipeline schedule takes the input gradients first and the weight gradients later, two passes
    through the loss (parallel/pipeline.py asks `twice`): torch's op keeps its gradients for the second."""
    head = copy.deepcopy(model.lm_head)
    ids, labels = batch()
    hidden = model(ids, hidden_states=True).detach().requires_grad_()
    plain = CrossEntropy()(head(hidden), labels)
    want = torch.autograd.grad(plain, [hidden, head.weight])
    loss = CrossEntropy(impl="fused", chunk_size=7).fused(hidden, head, labels, twice=True)
    got = [torch.autograd.grad(loss, hidden, retain_graph=True)[0], torch.autograd.grad(loss, head.weight)[0]]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    once = CrossEntropy(impl="fused", chunk_size=7).fused(hidden, head, labels)
    torch.autograd.grad(once, hidden, retain_graph=True)
    with pytest.raises(RuntimeError, match="called twice"):
        torch.autograd.grad(once, head.weight)
