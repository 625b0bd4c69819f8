"""`loss.impl=fused` under every parallel layout ends with one process's plain-loss weights after 3 steps (1e-5):

- ddp and fsdp (torch's `F.linear_cross_entropy` on the whole head weight; under FSDP2 the head runs as a
  registered forward method, its weight gathered); DeepSpeed's ZeRO-3 (the chunked path through the head module,
  whose hooks gather its partitioned weight);
- tensor parallel, with and without sequence parallel (the chunked path on each rank's vocab shard of a chunk's
  logits, the log-sum-exp reduced over the tp ranks), the pipeline's last stage and context parallel, these three
  with label smoothing and z-loss (the chunked path: torch's op has neither);
- the zero-bubble pipeline schedule zbv (2 stages per rank, so 4 layers in every run here), whose backward runs
  through the loss twice (input gradients, then weight gradients): torch's op keeps its gradients for that.

A loss chunk is 100 tokens, which divides no rank's tokens. One validation batch after the last step runs the plain
path (the pipeline's last stage: its head on the hidden states): its val/loss is one process's too.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import layout_weights
from test_recipe import COMMON, LAYOUTS

pytestmark = pytest.mark.multiprocess

SMOOTH = ["loss.z_loss=1e-4", "loss.label_smoothing=0.1"]
FUSED = ["loss.impl=fused", "loss.chunk_size=100"]
BASE = ["trainer.limit_val_batches=1", "model.num_hidden_layers=4"]  # a validation batch; 4 layers for zbv
LAYOUTS = {
    **LAYOUTS,
    "tp_sp": (2, 8, [*LAYOUTS["tp"][2], "strategy.sequence_parallel=true"]),
    "zero3": (2, 4, ["strategy=deepspeed", "strategy.stage=3"]),
    "pp_zbv": (2, 8, [*LAYOUTS["pp"][2], "strategy.pp_schedule=zbv"]),
}
RUNS = {  # name: (layout, overrides, the plain one-process run it must equal)
    "plain": ("auto", [], None),
    "plain_smooth": ("auto", SMOOTH, None),
    "ddp": ("ddp", FUSED, "plain"),
    "fsdp": ("fsdp", FUSED, "plain"),
    "zero3": ("zero3", FUSED, "plain"),
    "tp": ("tp", FUSED, "plain"),
    "tp_sp": ("tp_sp", [*FUSED, *SMOOTH], "plain_smooth"),
    "pp": ("pp", [*FUSED, *SMOOTH], "plain_smooth"),
    "cp": ("cp", [*FUSED, *SMOOTH], "plain_smooth"),
    "pp_zbv": ("pp_zbv", FUSED, "plain"),
}


def final_val_loss(run: Path) -> float:
    with open(run / "csv" / "metrics.csv") as f:
        return float([r["val/loss"] for r in csv.DictReader(f) if r.get("val/loss")][-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """Each run's weights after 3 steps and its final val/loss."""
    tmp = tmp_path_factory.mktemp("fused_loss")
    out = {}
    for name, (layout, overrides, _) in RUNS.items():
        ranks, batch, args = LAYOUTS[layout]
        run = tmp / name
        weights = layout_weights(
            run, *COMMON, *BASE, *overrides, *args, ranks=ranks, batch=batch, cwd=tmp, cache=data_cache
        )
        out[name] = weights, final_val_loss(run)
    return out


CASES = [name for name, (_, _, reference) in RUNS.items() if reference]


@pytest.mark.parametrize("name", CASES)
def test_the_fused_loss_trains_each_layout_as_one_process_with_the_plain_loss(name, runs):
    (actual, val_loss), (expected, expected_val_loss) = runs[name], runs[RUNS[name][2]]
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-5, msg=key)
    assert val_loss == pytest.approx(expected_val_loss, abs=1e-5)


def test_smoothing_and_z_loss_changed_the_training(runs):
    """Else the smoothed runs' parity would say nothing about the fused path's smoothing and z-loss."""
    plain, smooth = runs["plain"][0], runs["plain_smooth"][0]
    assert max((plain[k] - smooth[k]).abs().max().item() for k in plain) > 1e-4
