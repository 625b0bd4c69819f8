"""The mixture-of-experts block (models/moe.py, its losses: moe_losses.py) in one process: the grouped GEMM against
each expert run on its own tokens, dropless routing (every count adds up to tokens x top_k), the router's variants
(softmax, sigmoid, shared experts, loss-free bias), the losses' values against their formulas and the global-batch
counts (the balancing shares of two half batches summed are the whole batch's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import MLP
from parallama.models.moe import MoE
from parallama.models.moe_losses import (
    add_losses_in_backward,
    auxiliary_loss,
    pipeline_losses,
    update_expert_biases,
)

H, WIDTH, E, K = 16, 8, 4, 2


def block(**kwargs) -> MoE:
    torch.manual_seed(0)
    moe = MoE(H, WIDTH, E, K, **kwargs)
    moe.init_weights(0.3, 0.3)
    return moe


def reference(moe: MoE, x):
    """Each token through its chosen experts one by one, as transformers' loop does."""
    x = x.reshape(-1, H)
    weights, experts, _, _ = moe.gate(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            gate, up = F.linear(x[t], moe.experts.gate_up_proj[e]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, moe.experts.down_proj[e])
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"norm_topk_prob": False}, {"score_func": "sigmoid"}, {"bias_update_rate": 0.01}, {"shared": True}],
    ids=["softmax", "unnormalized", "sigmoid", "bias", "shared"],
)
def test_grouped_experts_equal_each_expert_on_its_tokens(kwargs):
    if kwargs.pop("shared", False):
        kwargs["shared_experts"] = MLP(
            LlamaConfig(hidden_size=H, intermediate_size=24, num_attention_heads=4)
        )
    moe = block(**kwargs)
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(x).reshape(-1, H), reference(moe, x), atol=1e-6, rtol=1e-5)
    y = moe(x)  # training: the routing is recorded, and every token counted top_k times (dropless)
    assert moe.routing.tokens_per_expert.sum() == 15 * K
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in moe.parameters())


def test_the_losses_are_their_formulas():
    moe = block(aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(2))
    moe(x)
    logits = F.linear(x, moe.gate.weight)
    probs = logits.softmax(-1)
    counts = torch.bincount(probs.topk(K).indices.flatten(), minlength=E).float()
    aux = E * ((counts / 20) * probs.mean(0)).sum()  # Hugging Face's: shares sum to top_k
    z = torch.logsumexp(logits, -1).square().mean()
    loss, metrics = auxiliary_loss([moe])
    torch.testing.assert_close(loss, 0.1 * aux + 0.01 * z)
    torch.testing.assert_close(metrics["aux_loss"], aux.detach())
    torch.testing.assert_close(metrics["expert_imbalance"], counts.max() / counts.mean())
    assert moe.routing is None  # read once


def test_global_counts_make_half_batches_the_whole_batchs_loss():
    """Two ranks holding half a batch each, their counts summed (what `count_group` does), average to the loss
    and the gradient of one rank holding it all."""
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(3))
    whole = block(aux_loss_coef=1.0)
    whole(x)
    want, _ = auxiliary_loss([whole])
    want.backward()
    halves, losses = block(aux_loss_coef=1.0), []
    routings = []
    for part in x:
        halves(part)
        routings.append(halves.routing)
    total = sum(r.tokens_per_expert for r in routings)
    for r in routings:
        halves.routing = r
        r.tokens_per_expert = total  # as after the all-reduce
        losses.append(auxiliary_loss([halves])[0])
    mean = sum(losses) / 2
    mean.backward()
    torch.testing.assert_close(mean, want)
    torch.testing.assert_close(halves.gate.weight.grad, whole.gate.weight.grad)


def test_loss_free_bias_moves_towards_the_idle_experts():
    """The step's global counts move the bias (down for the loaded experts, up for the others); the bias changes
    which experts are chosen, not their weights."""
    moe = block(bias_update_rate=0.5)
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(4))
    moe(x)
    counts = moe.routing.tokens_per_expert.float()
    auxiliary_loss([moe])
    torch.testing.assert_close(moe.step_tokens, counts)
    update_expert_biases([moe])
    torch.testing.assert_close(moe.gate.expert_bias, 0.5 * torch.sign(counts.mean() - counts))
    assert moe.step_tokens is None
    with torch.no_grad():
        moe.gate.expert_bias.copy_(torch.tensor([-100.0, 0, 0, 0]))
        weights, experts, scores, _ = moe.gate(x)
        assert not (experts == 0).any()
        torch.testing.assert_close(
            weights, scores.gather(-1, experts) / scores.gather(-1, experts).sum(-1, True)
        )


def whole_batch_reference(batch, **kwargs) -> tuple[MoE, torch.Tensor]:
    """One forward of the whole batch, its router losses added to a stand-in for the model's loss."""
    moe = block(**kwargs)
    loss = moe(batch).square().sum()
    aux, metrics = auxiliary_loss([moe])
    (loss + aux).backward()
    return moe, metrics


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_pipeline_stage_adds_the_whole_steps_losses_in_backward(checkpointed):
    """A pipeline stage (`add_losses_in_backward`) running every microbatch's forward before the backwards
    (gpipe), each microbatch's loss part of the step's (weight 1 / microbatches): the routers' gradients and the
    losses' value are those of the whole batch in one forward, the balancing shares being the step's. Under
    activation checkpointing the recomputation (a forward inside backward) records nothing more. torch's early
    stop (on by default) ends a recomputation at its last saved tensor, before the record: off here."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    kwargs = dict(aux_loss_coef=0.1, z_loss_coef=0.01, bias_update_rate=0.5)
    batch = torch.randn(4, 5, H, generator=torch.Generator().manual_seed(1))
    whole, want = whole_batch_reference(batch, **kwargs)
    moe = block(**kwargs)
    add_losses_in_backward([moe], weight=1 / 2, microbatches=2)
    with set_checkpoint_early_stop(False):
        outs = [checkpoint(moe, x, use_reentrant=False) if checkpointed else moe(x) for x in batch.chunk(2)]
        sum(out.square().sum() for out in outs).backward()
    assert len(moe.stage.forwards) == 2 and moe.stage.backwards_saw == [2, 2]
    for got, expected in zip(moe.parameters(), whole.parameters()):
        torch.testing.assert_close(got.grad, expected.grad)
    value, metrics = pipeline_losses([moe], num_blocks=1, group=None, device="cpu")
    torch.testing.assert_close(value, 0.1 * want["aux_loss"] + 0.01 * want["router_z_loss"])
    for name in want:
        torch.testing.assert_close(metrics[name], want[name])
    torch.testing.assert_close(moe.step_tokens, whole.step_tokens)  # loss-free balancing: the step's counts
    assert moe.stage is None


def test_a_schedule_that_runs_a_backward_before_the_steps_last_forward_is_refused():
    """1F1B's order (forward, backward, forward, backward): the first backward had half the step's counts."""
    moe = block(aux_loss_coef=0.1)
    add_losses_in_backward([moe], weight=1 / 2, microbatches=2)
    for x in torch.randn(2, 5, H).unbind():
        moe(x).sum().backward()
    with pytest.raises(RuntimeError, match="ran a backward before every forward of its step"):
        pipeline_losses([moe], num_blocks=1, group=None, device="cpu")


def test_loss_free_balancing_in_a_stage_takes_the_steps_counts_under_any_schedule():
    """Without the load-balancing loss nothing in backward reads the counts: 1F1B's order is fine, and the bias
    moves by the step's microbatches' counts (the z-loss gradient still added)."""
    batch = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(5))
    kwargs = dict(z_loss_coef=0.01, bias_update_rate=0.5)
    whole, _ = whole_batch_reference(batch, **kwargs)
    moe = block(**kwargs)
    add_losses_in_backward([moe], weight=1 / 2, microbatches=2)
    for x in batch.unbind():
        moe(x).square().sum().backward()
    pipeline_losses([moe], num_blocks=1, group=None, device="cpu")
    torch.testing.assert_close(moe.step_tokens, whole.step_tokens)
    for got, expected in zip(moe.parameters(), whole.parameters()):
        torch.testing.assert_close(got.grad, expected.grad)
