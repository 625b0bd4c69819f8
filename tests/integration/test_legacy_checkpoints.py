"""Checkpoints written before the package was reshaped by concept still resume, exactly.

tests/legacy/<format>/ holds what the code of tests/legacy/make_checkpoints.py's LEGACY_COMMIT wrote (a single
file, an FSDP DCP folder, a DeepSpeed ZeRO-2 folder, and a single file of a vocabulary of 300, from before the
head's matmul was padded to 320) and how that old code continued it: the new code must continue each one to the
same weights, the same loss at every step (and validation loss, where it was recorded) and the same tokens seen,
and export the true vocabulary. They predate checksums: each loads with the one line that says so.

Bit for bit only on a machine like the one that wrote them: CPU kernels round differently across instruction
sets (on an AVX-512 EPYC the continuation differs from the stored one by 1-2 float32 ulps, 3.7e-9 to 7.5e-9 on
weights near 0.03; on an AVX2 EPYC, Milan, the vocab300 embedding by up to 1.3e-7, 17 ulps: its rows' gradients
are sums over their tokens, in another order, and Adam divides a rarely seen row's small gradient by its own
scale). So weights are compared to ATOL: a checkpoint read wrongly (a lost optimizer moment, a shifted data
position, another schedule) moves them by 1e-5 or more in these steps.

`train/loss` is compared where one process wrote the checkpoint: the old code logged rank 0's own micro-batch loss
under fsdp and deepspeed, today's the mean over the data-parallel replicas (what one process logs for the global
batch), so their stored losses are other quantities; their weights and tokens seen are still compared.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file

from parallama.cli.export import main as export_hf

LEGACY = Path(__file__).resolve().parents[1] / "legacy"
ATOL = 1e-6


@pytest.mark.parametrize(
    "name",
    [
        "file",
        "vocab300",
        pytest.param("fsdp", marks=pytest.mark.multiprocess),
        pytest.param("deepspeed", marks=pytest.mark.multiprocess),
    ],
)
def test_a_pre_reshape_checkpoint_resumes_exactly(name, tmp_path, data_cache):
    reference = json.loads((LEGACY / name / "reference.json").read_text())
    ckpt = tmp_path / "last.ckpt"  # a copy: the fixture stays as the old code wrote it
    (shutil.copytree if (LEGACY / name / "last.ckpt").is_dir() else shutil.copy2)(
        LEGACY / name / "last.ckpt", ckpt
    )
    run_dir = tmp_path / "run"
    proc = run_cli(
        "parallama.cli.train",
        *reference["overrides"],
        f"trainer.max_steps={reference['resumed_to']}",
        f"ckpt_path={ckpt}",
        f"paths.cache_dir={data_cache}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=600,  # a fresh environment JIT-builds DeepSpeed's CPU op on its first DeepSpeed run
    )
    notes = [line for line in (proc.stdout + proc.stderr).splitlines() if "checksums" in line]
    assert notes == [
        f"checkpoint {ckpt} carries no checksums (written before they were recorded): not verified"
    ]
    export_hf([f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"out_dir={tmp_path / 'hf'}"])
    actual, expected = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(LEGACY / name / "resumed.safetensors"),
    )
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=ATOL, msg=key)
    vocab = json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"]
    assert vocab == expected["lm_head.weight"].shape[0]
    with open(run_dir / "csv" / "metrics.csv") as f:
        every = list(csv.DictReader(f))
    rows = [r for r in every if r.get("train/loss")]
    if "trainer.devices=1" in reference["overrides"]:
        # The references number a step's loss as metrics.csv did then: by the steps before it (today: after it).
        losses = {str(int(r["step"]) - 1): float(r["train/loss"]) for r in rows}
        assert losses == pytest.approx(reference["train_loss"], rel=0, abs=1e-6)
    if "val_loss" in reference:  # recorded since the vocab300 checkpoint; steps numbered as train_loss's
        val = {str(int(r["step"]) - 1): float(r["val/loss"]) for r in every if r.get("val/loss")}
        assert val == pytest.approx(reference["val_loss"], rel=0, abs=1e-6)
    assert float(rows[-1]["train/tokens_seen"]) == reference["tokens_seen"]
