"""An optimizer with modes (schedule-free's `train()`/`eval()`) trains with no callback of the user's: it is in train
mode for its steps and in eval mode outside them, so validation, every checkpoint and what is evaluated from one
use the evaluation weights. Two checkpoints of the same step (last.ckpt, written after the step, and the best one,
written after validating it) hold the same weights and evaluate to the loss the run logged; a schedule that warms
up on top of the optimizer's own warmup gets one warning. (ddp: tests/distributed/test_recipe.py.)"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import train

from parallama.checkpoint.read import load_checkpoint
from parallama.checkpoint.untrusted import load_weights_only
from parallama.cli.evaluate import main as eval_main

SCHEDULE_FREE = ["optimizer._target_=schedulefree.AdamWScheduleFree", "optimizer.lr=3e-3"]


def test_schedule_free_trains_and_its_checkpoints_of_a_step_evaluate_equal(tmp_path, data_cache, capsys):
    run = tmp_path / "run"
    proc = train(
        *SCHEDULE_FREE,
        "+optimizer.warmup_steps=2",
        "scheduler.warmup_steps=2",
        cwd=tmp_path,
        cache=data_cache,
        run_dir=run,
    )
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "warms it up again" in line]
    assert len(warnings) == 1 and "optimizer.warmup_steps=2" in warnings[0], warnings
    last, best = run / "checkpoints" / "last.ckpt", run / "checkpoints" / "step0000004.ckpt"
    assert load_checkpoint(last).meta["global_step"] == load_checkpoint(best).meta["global_step"] == 4
    for ckpt in (last, best):  # saved in eval mode: the weights are the average, the optimizer knows it
        groups = load_weights_only(ckpt)["optimizer_states"][0]["param_groups"]
        assert not any(group["train_mode"] for group in groups)
    for key, tensor in load_checkpoint(last).state_dict.items():
        assert torch.equal(tensor, load_checkpoint(best).state_dict[key]), key
    with open(run / "csv" / "metrics.csv") as f:
        logged = [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")][-1]
    eval_main([f"ckpt_path={last}", "max_batches=2", "json=true"])  # the best one holds the same weights
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["loss"] == pytest.approx(logged, rel=1e-5)
