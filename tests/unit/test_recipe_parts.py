"""The recipe's parts as `_target_`s (conf/optimizer, conf/scheduler, conf/loss, `module`): each builds from its
config, computes what it says, and a bad one is one line before any work. Training with them under every layout:
tests/distributed/test_recipe.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallama import CONF_DIR
from parallama.app.compose import preflight
from parallama.errors import ConfigError
from parallama.training.loss import CrossEntropy
from parallama.training.schedules import Constant, WarmupCosine, WarmupStableDecay, torch_scheduler


def test_the_loss_is_torchs_cross_entropy_with_label_smoothing_and_z_loss():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 32, requires_grad=True)
    labels = torch.randint(0, 32, (2, 5))
    labels[0, :2] = -100  # ignored: neither loss term counts them
    flat, kept = logits.flatten(0, 1), labels.flatten()
    assert torch.equal(CrossEntropy()(logits, labels), F.cross_entropy(flat, kept, ignore_index=-100))

    smoothed = F.cross_entropy(flat, kept, ignore_index=-100, label_smoothing=0.1)
    z = torch.logsumexp(flat, -1)[kept != -100].square().mean()
    loss = CrossEntropy(label_smoothing=0.1, z_loss=1e-2)
    torch.testing.assert_close(loss(logits, labels), smoothed + 1e-2 * z)
    # the pipeline and context parallel sum over a microbatch and divide by the whole batch's count themselves
    torch.testing.assert_close(loss(logits, labels, reduction="sum"), (smoothed + 1e-2 * z) * 8)


@pytest.mark.parametrize(
    "schedule, expected",
    [
        # 10 warmup steps from 0.1, then the peak, the last 20 of 100 steps decaying linearly to 0
        (
            WarmupStableDecay(warmup_steps=10, decay_fraction=0.2),
            {0: 0.1, 5: 0.55, 10: 1, 79: 1, 80: 1, 90: 0.5, 100: 0},
        ),
        (Constant(), {0: 1, 50: 1, 100: 1}),
        (Constant(warmup_steps=4, warmup_start_factor=0.0), {0: 0, 2: 0.5, 4: 1, 100: 1}),
        (WarmupCosine(warmup_steps=10, min_lr_ratio=0.0), {10: 1, 55: 0.5, 100: 0}),
    ],
)
def test_schedules(schedule, expected):
    lr_lambda = schedule.lr_lambda(100)
    assert {step: lr_lambda(step) for step in expected} == pytest.approx(expected)
    assert (
        lr_lambda.__dict__ == {}
    )  # nothing of it goes into LambdaLR's checkpoint: a resume follows its config


def test_a_torch_scheduler_takes_the_runs_length_and_peak_where_left_out():
    def built(target: str, **keywords):
        groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in (1e-3, 2e-3)]
        optimizer = torch.optim.AdamW(groups)
        config = {"_target_": f"torch.optim.lr_scheduler.{target}", **keywords}
        return torch_scheduler(config, optimizer, 40), optimizer

    one_cycle, optimizer = built("OneCycleLR")
    assert one_cycle.total_steps == 40 and [g["max_lr"] for g in optimizer.param_groups] == [1e-3, 2e-3]
    assert built("OneCycleLR", max_lr=5e-3, total_steps=50)[0].total_steps == 50
    # a length of the user's, as torch counts it
    assert built("OneCycleLR", epochs=2, steps_per_epoch=30)[0].total_steps == 60
    assert built("CosineAnnealingLR")[0].T_max == 40
    assert built("LinearLR", total_iters=5)[0].total_iters == 5
    assert built("StepLR", step_size=10)[0].step_size == 10  # no length to fill


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["optimizer._target_=torch.optim.SGD"],
            r"^optimizer._target_=torch.optim.sgd.SGD does not take the ",
        ),
        (
            ["optimizer._target_=torch.optim.Nope"],
            r"^optimizer._target_=torch.optim.Nope: cannot be imported \(No module named",
        ),
        (["~optimizer._target_"], r"^optimizer has no _target_; name the class to build"),
        (
            ["strategy=deepspeed", "strategy.offload_optimizer=true", "optimizer._target_=torch.optim.NAdam"],
            r"^strategy.offload_optimizer=true steps with DeepSpeed's CPU Adam, not optimizer._target_=",
        ),
        (
            ["strategy=deepspeed", "optimizer=muon"],
            r"^optimizer=muon cannot run under strategy=deepspeed \(ZeRO partitions",
        ),
        (
            ["optimizer=muon", "optimizer.ns_dtype=fp16"],
            r"^optimizer.ns_dtype=fp16 is not valid; use bfloat16 or",
        ),
        (
            ["optimizer=muon", "optimizer.adjust_lr=rms"],
            r"^optimizer.adjust_lr=rms is not valid; use match_rms",
        ),
        (
            ["optimizer=muon", "optimizer.adamw_betas=[0.9,1.5]"],
            r"^optimizer.adamw_betas=\[0.9, 1.5\] is not valid; use two numbers in \[0, 1\)",
        ),
        (["scheduler=wsd", "scheduler.decay_fraction=2"], r"^scheduler.decay_fraction=2 is not valid; use a"),
        (
            ["scheduler=constant", "+scheduler.min_lr_ratio=0.1"],
            r"^scheduler._target_=.*Constant: .*min_lr_ratio",
        ),
        (  # the default schedule's keys, left beside torch's class
            ["scheduler._target_=torch.optim.lr_scheduler.OneCycleLR"],
            r"^scheduler.warmup_steps is not a keyword of torch.optim.lr_scheduler.OneCycleLR \(nor "
            r"scheduler.warmup_start_factor, scheduler.min_lr_ratio\); drop it, or give the class its own keys",
        ),
        (
            ["scheduler=one_cycle", "scheduler.pct_start=2"],
            r"^scheduler.pct_start=2: Expected float between 0 and 1 pct_start, but got 2$",
        ),
        (
            ["scheduler=one_cycle", "+scheduler.total_steps=10", "trainer.max_steps=20"],
            r"^scheduler.total_steps=10 is below trainer.max_steps=20; leave it out",
        ),
        (  # torch's own words, naming no key alone
            ["scheduler=one_cycle", "+scheduler.max_lr=fast"],
            r"^scheduler._target_=torch.optim.lr_scheduler.OneCycleLR: unsupported operand type",
        ),
        (
            ["~scheduler", "+scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau"],
            r"^scheduler._target_=torch.optim.lr_scheduler.ReduceLROnPlateau steps on a metric",
        ),
        (["loss.z_loss=-1"], r"^loss.z_loss=-1 is not valid; use a number >= 0$"),
        (["loss.label_smoothing=1"], r"^loss.label_smoothing=1 is not valid; use a number in \[0, 1\)$"),
        (
            ["module._target_=torch.nn.Linear"],
            r"^module._target_=torch.nn.Linear is not a subclass of .*CausalLM$",
        ),
    ],
)
def test_a_bad_part_is_one_line_before_work(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        preflight(CONF_DIR, "train", ["trainer.accelerator=cpu", *overrides])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "~optimizer.betas",
            "~optimizer.lr",
        ],  # the class's defaults (found: a 49-line traceback, a KeyError)
        ["~scheduler.warmup_steps"],
        ["optimizer._target_=torch.optim.SGD", "~optimizer.betas", "~optimizer.eps"],
        [
            "optimizer._target_=torch.optim.NAdam"
        ],  # fused=null is parallama's choice: none where a class has none
        ["scheduler=wsd"],
        ["scheduler=constant"],
        ["scheduler=one_cycle", "optimizer=muon"],
        [
            "~scheduler",
            "+scheduler._target_=torch.optim.lr_scheduler.CosineAnnealingLR",
            "+scheduler.eta_min=1e-5",
        ],
        ["optimizer=muon"],
        ["optimizer=muon", "strategy=ddp_sharded"],
    ],
)
def test_keys_removed_or_another_class_pass_the_checks(overrides):
    preflight(CONF_DIR, "train", ["trainer.accelerator=cpu", *overrides])
