"""LightningModule pieces and config checks that need no training run (compile: tests/integration/test_compile.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from parallama import CONF_DIR
from parallama.app.checks import check_config
from parallama.app.compose import preflight
from parallama.errors import ConfigError
from parallama.training.module import CausalLM
from parallama.training.schedules import warmup_cosine

SCHED = dict(warmup_steps=10, total_steps=110, start_factor=0.1, min_ratio=0.0)


def test_schedule_warmup_peak_end():
    assert warmup_cosine(0, **SCHED) == pytest.approx(0.1)
    assert warmup_cosine(5, **SCHED) == pytest.approx(0.55)
    assert warmup_cosine(10, **SCHED) == pytest.approx(1.0)  # peak right after warmup
    assert warmup_cosine(60, **SCHED) == pytest.approx(0.5)  # cosine midpoint
    assert warmup_cosine(110, **SCHED) == pytest.approx(0.0)
    assert warmup_cosine(500, **SCHED) == pytest.approx(0.0)  # stays at the floor past the end
    assert warmup_cosine(110, **{**SCHED, "min_ratio": 0.1}) == pytest.approx(0.1)
    values = [warmup_cosine(s, **SCHED) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def tiny_module(**overrides) -> CausalLM:
    model = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    optimizer = dict(
        _target_="torch.optim.AdamW", lr=1e-3, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.1, fused=None
    )
    scheduler = dict(
        _target_="parallama.training.schedules.WarmupCosine",
        warmup_steps=2,
        warmup_start_factor=0.1,
        min_lr_ratio=0.0,
    )
    module = CausalLM(model=model, optimizer=optimizer, scheduler=scheduler, **overrides)
    module.configure_model()
    return module


class _FakeTrainer:
    estimated_stepping_batches = 20
    strategy = None
    fast_dev_run = 0
    gradient_clip_val = 1.0


def test_decay_groups_and_schedule_wiring(monkeypatch):
    module = tiny_module()
    monkeypatch.setattr(CausalLM, "trainer", property(lambda self: _FakeTrainer()))
    conf = module.configure_optimizers()
    optimizer, scheduler = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])  # every matrix (embeddings, projections, lm_head)
    assert all(p.ndim == 1 for p in no_decay["params"])  # RMSNorm weights
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.model.parameters()))
    assert conf["lr_scheduler"]["interval"] == "step"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)  # warmup starts at 0.1 x peak
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_a_torch_scheduler_is_wired_as_the_schedules_are(monkeypatch):
    """scheduler._target_ naming torch's OneCycleLR: built on the optimizer over the run's steps, stepped per
    optimizer step, logged under the optimizer's name."""
    module = tiny_module()
    module.hparams.scheduler = {"_target_": "torch.optim.lr_scheduler.OneCycleLR", "_partial_": True}
    trainer = _FakeTrainer()
    monkeypatch.setattr(CausalLM, "trainer", property(lambda self: trainer))
    conf = module.configure_optimizers()
    scheduler = conf["lr_scheduler"]["scheduler"]
    assert isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR) and scheduler.total_steps == 20
    assert conf["lr_scheduler"]["interval"] == "step" and conf["lr_scheduler"]["name"] == "lr-AdamW"
    assert [group["max_lr"] for group in conf["optimizer"].param_groups] == [1e-3, 1e-3]  # optimizer.lr


def test_warmup_longer_than_training_is_rejected(monkeypatch):
    module = tiny_module()
    trainer = _FakeTrainer()
    trainer.estimated_stepping_batches = 2
    monkeypatch.setattr(CausalLM, "trainer", property(lambda self: trainer))
    with pytest.raises(ConfigError, match="scheduler.warmup_steps=2"):
        module.configure_optimizers()

    trainer.fast_dev_run = 1  # a smoke test of a preset: its one step takes the auto warmup
    trainer.estimated_stepping_batches = 1
    module.configure_optimizers()


def test_activation_checkpointing_keeps_gradients_and_names():
    torch.manual_seed(0)
    plain, checkpointed = tiny_module(), tiny_module(activation_checkpointing=True)
    checkpointed.model.load_state_dict(plain.model.state_dict())
    assert plain.model.state_dict().keys() == checkpointed.model.state_dict().keys()
    ids = torch.randint(0, 64, (2, 16))
    for module in (plain, checkpointed):
        module.model(ids).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(plain.model.named_parameters(), checkpointed.model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def compose_train(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_global_batch_derives_accumulation():
    cfg = compose_train(
        "global_batch_size=64", "data.batch_size=8", "trainer.accelerator=cpu", "trainer.devices=2"
    )
    check_config(cfg)
    assert cfg.trainer.accumulate_grad_batches == 4


@pytest.mark.parametrize(
    "overrides, batch, accumulate",
    [
        (["trainer.devices=1"], 64, 1),  # one GPU: the global batch in one micro-batch
        (["trainer.devices=2"], 32, 1),
        (["trainer.devices=2", "trainer.accumulate_grad_batches=4"], 8, 4),
    ],
)
def test_a_null_batch_size_takes_the_global_batch_per_replica(overrides, batch, accumulate):
    """conf/experiment/article_180m.yaml's `data.batch_size: null`: one preset for one GPU and for eight."""
    cfg = compose_train("global_batch_size=64", "data.batch_size=null", "trainer.accelerator=cpu", *overrides)
    check_config(cfg)
    assert (cfg.data.batch_size, cfg.trainer.accumulate_grad_batches) == (batch, accumulate)


@pytest.mark.parametrize("preset", ["tiny", "llama_180m", "llama3_2_1b", "llama3_8b"])
def test_model_presets_validate_and_have_the_documented_size(preset):
    from omegaconf import OmegaConf

    from parallama.models import model_spec

    fields = OmegaConf.to_container(compose_train(f"model={preset}").model)
    fields["vocab_size"] = fields["vocab_size"] or 320
    config = model_spec(fields).build_config(fields)
    params = config.num_params()
    expected = {
        "tiny": (0.8e6, 0.95e6),
        "llama_180m": (179e6, 180e6),
        "llama3_2_1b": (1.23e9, 1.24e9),
        "llama3_8b": (8.0e9, 8.06e9),
    }[preset]
    assert expected[0] <= params <= expected[1], params
    assert math.isfinite(config.flops_per_token(512))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["strategy=ddp", "strategy.process_group_backend=nccl", "trainer.accelerator=cpu"],
            "process_group_backend=nccl needs GPUs",
        ),
        (
            ["strategy=fsdp", "strategy.mixed_precision=fp16", "trainer.accelerator=cpu"],
            "mixed_precision=fp16 needs GPUs",
        ),
        (
            ["trainer.accelerator=cpu", "trainer.devices=512"],
            "trainer.devices=512 CPU processes but this machine has",
        ),
    ],
)
def test_strategy_that_cannot_run_on_the_accelerator(overrides, message):
    with pytest.raises(ConfigError, match=message):
        preflight(CONF_DIR, "train", overrides)


def test_adamw_is_fused_unless_fp16s_loss_scaler_unscales_after_clipping():
    """fp16-mixed: a fused AdamW unscales inside its step, after Lightning clipped the still-scaled gradients, so
    the GPU default falls back to foreach and an explicit fused=true is refused in one line. (bf16-mixed clips a
    fused AdamW: tests/integration/test_matrix.py's ddp_bf16_mixed case.)"""
    from functools import partial

    from parallama.training.optim import with_fused_default

    def fused(value, **where):
        return with_fused_default(partial(torch.optim.AdamW, lr=1e-3, fused=value), **where).keywords["fused"]

    assert fused(None, on_gpu=True, loss_scaled=False, clipping=True)
    assert not fused(None, on_gpu=True, loss_scaled=True, clipping=True)
    assert not fused(None, on_gpu=False, loss_scaled=False, clipping=True)
    with pytest.raises(ConfigError, match=r"^optimizer.fused=true with trainer.precision=16-mixed .*; set "):
        fused(True, on_gpu=True, loss_scaled=True, clipping=True)
    assert fused(True, on_gpu=True, loss_scaled=True, clipping=False)
    # an optimizer without the key is left as configured
    assert (
        "fused"
        not in with_fused_default(
            partial(torch.optim.SGD), on_gpu=True, loss_scaled=False, clipping=False
        ).keywords
    )


def test_clipping_goes_through_lightnings_hook_to_the_strategy():
    """CausalLM.configure_gradient_clipping (Lightning's public hook) hands the clipping to the strategy, which
    clips a fused AdamW under bf16-mixed (no loss scaler: true gradients), where Lightning's MixedPrecision
    would refuse it."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import MixedPrecision

    from parallama.parallel.strategies.ddp import SingleDevice

    strategy = SingleDevice()
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    weight = torch.nn.Parameter(torch.zeros(4))
    weight.grad = torch.full((4,), 3.0)  # norm 6
    optimizer = torch.optim.AdamW([weight], fused=True)
    module = SimpleNamespace(trainer=SimpleNamespace(strategy=strategy))
    CausalLM.configure_gradient_clipping(
        module, optimizer, gradient_clip_val=1.5, gradient_clip_algorithm="norm"
    )
    assert weight.grad.norm().item() == pytest.approx(1.5)
    CausalLM.configure_gradient_clipping(
        module, optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="value"
    )
    assert weight.grad.max().item() == pytest.approx(0.5)
    CausalLM.configure_gradient_clipping(module, optimizer, gradient_clip_val=None)  # no clipping
    assert weight.grad.max().item() == pytest.approx(0.5)
