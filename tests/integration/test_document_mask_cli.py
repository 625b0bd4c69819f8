"""`data.document_mask=true` trains through the CLI under the wrappers of multi-GPU runs (the masking itself:
tests/unit/test_document_mask.py)."""

from __future__ import annotations

import csv
import math

import pytest
from conftest import train


def finite_train_losses(run_dir) -> list[float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        losses = [float(row["train/loss"]) for row in csv.DictReader(f) if row["train/loss"]]
    assert losses and all(math.isfinite(x) for x in losses)
    return losses


@pytest.mark.parametrize(
    "strategy",
    [
        # one process, but the model wrapped as in multi-GPU runs: the new forward arguments go through
        # FSDP2's hooks (bf16 compute), and through activation checkpointing's wrapper of every block
        ["strategy=fsdp", "strategy.mixed_precision=bf16", "activation_checkpointing=true"],
        pytest.param(
            ["strategy=ddp", "trainer.devices=2"], marks=[pytest.mark.multiprocess, pytest.mark.slow]
        ),
    ],
    ids=["fsdp1", "ddp2"],  # ddp2: ~40 s on 2 cores
)
def test_cli_trains_with_document_mask(strategy, tmp_path, data_cache):
    run = tmp_path / "run"
    train(
        "data.document_mask=true",
        "trainer.max_steps=2",
        *strategy,
        cwd=tmp_path,
        cache=data_cache,
        run_dir=run,
    )
    assert len(finite_train_losses(run)) == 2
