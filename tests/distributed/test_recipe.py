"""The recipe's parts are one override each, and every strategy trains with them as one process does.

- `optimizer._target_=torch.optim.Adam`, and an optimizer class of the user's own (AdaBelief, written below as a
  user would, imported from a module on PYTHONPATH): auto (the reference, one process), ddp and fsdp on 2 ranks,
  model_parallel tp=2 (its parameters DTensors): the same weights after 3 steps (1e-5).
- `optimizer=muon` (Muon on the blocks' matrices, AdamW on the rest): auto, ddp, ddp_sharded (whole matrices
  on their owner rank), fsdp (matrices sharded on dp_shard), tp=2 (sharded on tp), dp_shard=2 x tp=2 on 4 ranks
  (sharded on both) and pp=2 (whole stages) end with one process's weights (1e-5), Newton-Schulz in
  fp32 (`optimizer.ns_dtype=float32`): in bf16 (torch's, the default) its quintic iteration turns the last-bit
  differences of the layouts' gradient reductions into 1.6e-5 to 3.2e-5 in the weights after 3 steps (in fp32:
  3e-8), so the default is checked under fsdp and tp to 1e-4.
- `optimizer._target_=schedulefree.AdamWScheduleFree` (train and eval modes, set by the module): ddp as auto.
- `loss.z_loss=1e-4 loss.label_smoothing=0.1`: the pipeline (pp=2, the loss on the last stage), context parallel
  (cp=2, each rank's loss over its part of the sequences) and tensor parallel (tp=2, the loss on vocab-sharded
  logits) end with the weights of one process with the same loss.

Every layout trains on the global batch 8; the LR is constant and low (see test_model_parallel.py).
"""

from __future__ import annotations

import csv
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import layout_weights, train

pytestmark = pytest.mark.multiprocess

COMMON = [
    "scheduler=constant",
    "optimizer.lr=3e-4",
    "trainer.precision=32-true",
    "trainer.gradient_clip_val=0.5",
    "trainer.max_steps=3",
    "seed=7",
    "trainer.limit_val_batches=0",
    "validate_before_training=false",
    "sample.max_new_tokens=0",
]
LAYOUTS = {  # name: (ranks, per-rank batch, overrides)
    "auto": (1, 8, []),
    "ddp": (2, 4, ["strategy=ddp"]),
    "fsdp": (2, 4, ["strategy=fsdp"]),
    "tp": (2, 8, ["strategy=model_parallel", "strategy.tp=2"]),
    "pp": (2, 8, ["strategy=model_parallel", "strategy.pp=2"]),
    "cp": (2, 8, ["strategy=model_parallel", "strategy.cp=2"]),
    "ddp_sharded": (2, 4, ["strategy=ddp_sharded"]),
    "fsdp_tp": (4, 4, ["strategy=model_parallel", "strategy.tp=2"]),  # dp_shard=2 x tp=2
}
RECIPES = {  # name: (overrides, layouts)
    "adam": (["optimizer._target_=torch.optim.Adam"], ["auto", "ddp", "fsdp", "tp"]),
    "own_optimizer": (
        ["optimizer._target_=adabelief.AdaBelief"],  # fused=null: none for a class that has no fused kernel
        ["auto", "ddp", "fsdp", "tp"],
    ),
    "z_loss_smoothing": (["loss.z_loss=1e-4", "loss.label_smoothing=0.1"], ["auto", "pp", "cp", "tp"]),
    "muon": (
        ["optimizer=muon", "optimizer.ns_dtype=float32"],
        ["auto", "ddp", "ddp_sharded", "fsdp", "tp", "fsdp_tp", "pp"],
    ),
    "muon_bf16": (["optimizer=muon"], ["auto", "fsdp", "tp"]),
    # an optimizer with modes: in train mode for its steps, in eval mode outside them (the weights exported)
    "schedule_free": (["optimizer._target_=schedulefree.AdamWScheduleFree"], ["auto", "ddp"]),
}
TOLERANCE = {"muon_bf16": 1e-4}  # see above

ADABELIEF = '''
    import torch


    class AdaBelief(torch.optim.Optimizer):
        """AdaBelief (Zhuang et al., 2020): Adam whose second moment is the variance of the gradient around its
        running mean, with decoupled weight decay."""

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-16, weight_decay=0.0):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:  # Lightning runs the training step in it
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                (beta1, beta2), lr = group["betas"], group["lr"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["step"] = 0
                        state["exp_avg"], state["belief"] = torch.zeros_like(p), torch.zeros_like(p)
                    state["step"] += 1
                    m, s = state["exp_avg"], state["belief"]
                    m.lerp_(p.grad, 1 - beta1)
                    s.mul_(beta2).addcmul_(p.grad - m, p.grad - m, value=1 - beta2).add_(group["eps"])
                    m_hat = m / (1 - beta1 ** state["step"])
                    s_hat = s / (1 - beta2 ** state["step"])
                    p.mul_(1 - lr * group["weight_decay"])
                    p.addcdiv_(m_hat, s_hat.sqrt().add_(group["eps"]), value=-lr)
            return loss
'''


@pytest.fixture(scope="module")
def weights(tmp_path_factory, data_cache) -> dict:
    """Every (recipe, layout) run's weights after 3 steps, through parallama-export."""
    tmp = tmp_path_factory.mktemp("recipe")
    (tmp / "adabelief.py").write_text(textwrap.dedent(ADABELIEF))
    out = {}
    for recipe, (overrides, layouts) in RECIPES.items():
        for layout in layouts:
            ranks, batch, args = LAYOUTS[layout]
            out[recipe, layout] = layout_weights(
                tmp / f"{recipe}-{layout}",
                *COMMON,
                *overrides,
                *args,
                ranks=ranks,
                batch=batch,
                cwd=tmp,
                cache=data_cache,
                env={"PYTHONPATH": str(tmp)},
            )
    return out


CASES = [
    (recipe, layout) for recipe, (_, layouts) in RECIPES.items() for layout in layouts if layout != "auto"
]


@pytest.mark.parametrize("recipe, layout", CASES, ids=[f"{r}-{layout}" for r, layout in CASES])
def test_each_layout_trains_the_recipe_as_one_process(recipe, layout, weights):
    actual, expected = weights[recipe, layout], weights[recipe, "auto"]
    assert actual.keys() == expected.keys()
    tolerance = TOLERANCE.get(recipe, 1e-5)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=tolerance, atol=tolerance, msg=name)


@pytest.fixture(scope="module")
def default_weights(tmp_path_factory, data_cache) -> dict:
    tmp = tmp_path_factory.mktemp("recipe_default")
    return layout_weights(tmp / "run", *COMMON, ranks=1, batch=8, cwd=tmp, cache=data_cache)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_recipe_changes_the_training(recipe, weights, default_weights):
    """The overrides took effect: each recipe's weights are far from the default recipe's (else the parity above
    would say nothing about them)."""
    reference = weights[recipe, "auto"]
    diff = max((reference[k] - default_weights[k]).abs().max().item() for k in reference)
    assert diff > 1e-4 and math.isfinite(diff), diff


ACCURACY = (Path(__file__).resolve().parents[2] / "docs" / "customize.md").read_text()


@pytest.mark.parametrize("layout", ["tp", "pp", "cp"])
def test_a_validation_metric_on_the_logits_is_the_same_under_each_layout(layout, accuracy_runs):
    """docs/customize.md's token accuracy (`on_validation_logits`): the pipeline's last stage, the context-parallel
    ranks' parts of each sequence and tensor parallel's vocab-sharded logits give one process's value; so do
    val/loss, the cross-entropy alone, and the z-loss beside it (val/z_loss)."""
    for metric in ("val/accuracy", "val/loss", "val/z_loss"):
        assert accuracy_runs[layout][metric] == pytest.approx(accuracy_runs["auto"][metric], abs=1e-5), metric
    assert 0 < accuracy_runs["auto"]["val/accuracy"] < 1


@pytest.fixture(scope="module")
def accuracy_runs(tmp_path_factory, data_cache) -> dict:
    tmp = tmp_path_factory.mktemp("accuracy")
    source = re.search(r"<!-- file: myrecipe/accuracy.py -->\n```python\n(.*?)```", ACCURACY, re.S).group(1)
    (tmp / "token_accuracy.py").write_text(source)
    out = {}
    for layout in ("auto", "tp", "pp", "cp"):
        ranks, batch, args = LAYOUTS[layout]
        run = tmp / layout
        train(
            *COMMON,
            *args,
            "module._target_=token_accuracy.WithTokenAccuracy",
            "loss.z_loss=1e-4",
            "trainer.max_steps=1",
            "trainer.limit_val_batches=2",
            f"trainer.devices={ranks}",
            f"data.batch_size={batch}",
            cwd=tmp,
            cache=data_cache,
            run_dir=run,
            env={"PYTHONPATH": str(tmp)},
            timeout=600,
        )
        with open(run / "csv" / "metrics.csv") as f:
            row = next(r for r in csv.DictReader(f) if r.get("val/accuracy"))
            out[layout] = {
                metric: float(row[metric]) for metric in ("val/accuracy", "val/loss", "val/z_loss")
            }
    return out
