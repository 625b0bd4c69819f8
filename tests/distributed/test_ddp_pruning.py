"""A 2-rank ddp trial that the pruner stops: rank 0 alone talks to the study, every rank stops at the same step,
and the sweep goes on (no rank left waiting in a collective)."""

from __future__ import annotations

import csv

import optuna
import pytest
from conftest import train

from parallama.checkpoint.formats import client_state


@pytest.mark.multiprocess
def test_a_pruned_ddp_trial_stops_on_every_rank(tmp_path, data_cache):
    # Trial 0 (lr 3e-2) learns and finishes; trial 1 (lr 1e-6) learns nothing and is pruned at its first
    # validation of fit (step 2), once one trial has finished (pruner.n_startup_trials=1).
    args = ["hparams_search=lr_optuna", "strategy=ddp", "trainer.devices=2", "hydra.sweeper.n_trials=2"]
    args += [
        "pruner.n_startup_trials=1",
        "hydra.sweeper.enqueue_trials=[{optimizer.lr:3e-2},{optimizer.lr:1e-6}]",
    ]
    train(
        *args, cwd=tmp_path, cache=data_cache, timeout=600
    )  # a rank left behind would hang: the timeout fails
    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{tmp_path}/logs/optuna.db")
    done, pruned = study.get_trials()
    assert (done.state.name, pruned.state.name) == ("COMPLETE", "PRUNED")
    assert pruned.user_attrs["pruned_at_step"] == 2 and list(pruned.intermediate_values) == [2]
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    job = sweep / "1"
    assert (job / "train_ddp_process_1.log").exists()  # the trial's second rank ran, in the trial's directory
    assert (
        client_state(job / "checkpoints" / "last.ckpt")["global_step"] == 2
    )  # saved by every rank at step 2
    with open(job / "csv" / "metrics.csv") as f:
        assert max(int(r["step"]) for r in csv.DictReader(f) if r["train/loss"]) == 1
