"""`compile=true` through the LightningModule: inductor compiles each block in place (~10 s on CPU, a C++
compiler needed: gcc here), so it sits with the integration tests rather than the unit ones."""

from __future__ import annotations

import torch

from parallama.training.module import CausalLM

MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
OPTIMIZER = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.1, fused=None)
SCHEDULER = dict(warmup_steps=2, warmup_start_factor=0.1, min_lr_ratio=0.0)


def built(**overrides) -> CausalLM:
    module = CausalLM(model=MODEL, optimizer=OPTIMIZER, scheduler=SCHEDULER, **overrides)
    module.configure_model()
    return module


def test_compiled_blocks_match_eager():
    torch.manual_seed(0)
    eager, compiled = built(), built(compile=True)
    compiled.model.load_state_dict(eager.model.state_dict())
    assert eager.model.state_dict().keys() == compiled.model.state_dict().keys()
    ids = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(compiled.model(ids), eager.model(ids), rtol=1e-4, atol=1e-4)


def test_compiled_selective_checkpointing_and_float8_match_eager_gradients(monkeypatch):
    """compile traces each block's per-op selective checkpoint (AC before compile, as torchtitan) and its float8
    linears (torchao, emulated on CPU): the gradients of the eager float8 model without checkpointing (seen:
    1.7e-10 apart, gradients up to 6e-3). One compilation for both: inductor takes most of this test's time."""
    from torchao.float8.float8_linear import Float8Linear

    from parallama.parallel.base import OutsideATrainer

    monkeypatch.setattr(OutsideATrainer, "float8", "tensorwise")  # what parallama-train sets on its strategy
    monkeypatch.setattr(OutsideATrainer, "float8_filter", "all")  # the tiny model's linears are all small
    torch.manual_seed(0)
    eager = built()
    compiled = built(compile=True, activation_checkpointing="selective")
    assert isinstance(compiled.model.layers["0"].mlp.up_proj, Float8Linear)
    compiled.model.load_state_dict(eager.model.state_dict())
    ids = torch.randint(0, 64, (2, 16))
    for module in (eager, compiled):
        module.model(ids).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(eager.model.named_parameters(), compiled.model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_auto_is_on_for_cuda_only_and_an_explicit_value_wins():
    from parallama.distributed.options import compile_enabled

    assert compile_enabled("auto", "cuda") and not compile_enabled("auto", "cpu")
    assert compile_enabled(True, "cpu") and not compile_enabled(False, "cuda")
    module = built(compile="auto")  # outside a Trainer: the CPU
    assert module.compiled_loss is None
    assert all(block._compiled_call_impl is None for block in module.model.layers.values())
    assert all(block._compiled_call_impl is not None for block in built(compile=True).model.layers.values())


def test_the_loss_is_compiled_with_the_blocks_and_gives_eagers_loss_and_gradients():
    torch.manual_seed(0)
    eager, compiled = built(), built(compile=True)
    compiled.model.load_state_dict(eager.model.state_dict())
    assert eager.compiled_loss is None and compiled.compiled_loss is not None
    batch = {"input_ids": torch.randint(0, 64, (2, 16)), "labels": torch.randint(0, 64, (2, 16))}
    losses = [module.loss(batch) for module in (eager, compiled)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert "Compiled" in type(losses[1].grad_fn).__name__  # the compiled loss ran, not the eager one
    for loss in losses:
        loss.backward()
    for (name, a), (_, b) in zip(eager.model.named_parameters(), compiled.model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
