"""An optimizer with train and eval modes (schedule-free): recognized by its methods, refused in one line where the
strategy's wrapper hides them, and warned about once where a schedule warms up on top of its own warmup.
(Training with it: tests/integration/test_schedule_free.py.)"""

from __future__ import annotations

import schedulefree
import torch

from parallama.training.optim import has_modes, modes_refusal, set_modes, stacked_warmup
from parallama.training.schedules import WarmupCosine


def test_an_optimizer_with_modes_is_told_by_its_methods():
    assert has_modes(schedulefree.AdamWScheduleFree) and not has_modes(torch.optim.AdamW)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = schedulefree.AdamWScheduleFree([weight], lr=0.1)
    set_modes([optimizer], train=True)
    for grad in (1.0, -3.0):  # after one step the two points coincide
        weight.grad = torch.full((3,), grad)
        optimizer.step()
    trained = weight.detach().clone()
    set_modes([optimizer, torch.optim.AdamW([weight])], train=False)  # the one without modes is left alone
    assert not optimizer.param_groups[0]["train_mode"] and not torch.equal(weight, trained)
    set_modes([optimizer], train=True)
    torch.testing.assert_close(weight.detach(), trained)


def test_a_wrapper_that_hides_the_modes_is_one_line():
    class Wrapper:  # as ZeroRedundancyOptimizer and DeepSpeed's ZeRO optimizer: no train() / eval()
        pass

    line = modes_refusal(schedulefree.AdamWScheduleFree, [Wrapper()])
    assert line == (
        "optimizer._target_=schedulefree.adamw_schedulefree.AdamWScheduleFree has train and eval modes, which "
        "Wrapper does not pass on; use strategy=auto, ddp or fsdp"
    )
    optimizer = schedulefree.AdamWScheduleFree([torch.nn.Parameter(torch.ones(1))])
    assert modes_refusal(schedulefree.AdamWScheduleFree, [optimizer]) is None
    assert modes_refusal(torch.optim.AdamW, [Wrapper()]) is None


def warming_up(lr_lambda, **keywords):
    """A schedule-free optimizer at its first step under a LambdaLR of `lr_lambda`."""
    optimizer = schedulefree.AdamWScheduleFree([torch.nn.Parameter(torch.ones(1))], lr=3e-3, **keywords)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return optimizer


def test_a_warmup_on_top_of_the_optimizers_own_is_warned_about():
    optimizer = warming_up(WarmupCosine(warmup_steps=5).lr_lambda(100), warmup_steps=10)
    assert stacked_warmup(optimizer, [3e-3]) == (
        "optimizer.warmup_steps=10 warms the learning rate up itself, and the scheduler warms it up again on top "
        "(its multiplier starts at 0.1): use scheduler=constant, or optimizer.warmup_steps=0"
    )
    assert stacked_warmup(warming_up(lambda step: 1.0, warmup_steps=10), [3e-3]) is None
    assert stacked_warmup(warming_up(lambda step: 0.1), [3e-3]) is None
    # torch's OneCycleLR starts at max_lr / div_factor: a warmup too
    one_cycle = schedulefree.AdamWScheduleFree([torch.nn.Parameter(torch.ones(1))], lr=3e-3, warmup_steps=10)
    torch.optim.lr_scheduler.OneCycleLR(one_cycle, max_lr=3e-3, total_steps=100, cycle_momentum=False)
    assert "(its multiplier starts at 0.04)" in stacked_warmup(one_cycle, [3e-3])
