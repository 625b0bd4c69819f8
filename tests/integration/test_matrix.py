"""Precision (and float8) x strategy: each trains, validates after its last step, samples text at the end and exports.

The generation at the end of a run is where precision bites (the KV cache must be in the dtype attention
computes in: bf16 under autocast or FSDP mixed precision, fp32 weights otherwise), and each strategy wraps the
model its own way, so every strategy gets a precision of its own here. One process each: the code paths
do not depend on the world size, which test_strategies.py covers (with the loggers and validation options).
"""

from __future__ import annotations

import csv

import pytest
from conftest import train

from parallama.cli.export import main as export

CASES = {
    "fsdp_mixed_precision_bf16": ["strategy=fsdp", "strategy.mixed_precision=bf16", "logger=many"],
    "deepspeed_bf16_mixed": ["strategy=deepspeed", "trainer.precision=bf16-mixed", "logger=none"],
    "ddp_sharded_bf16_true": ["strategy=ddp_sharded", "trainer.precision=bf16-true"],
    # built on the meta device, materialized where the offloaded shards live (on a GPU: only buffers move to it)
    "fsdp_cpu_offload_meta_init": ["strategy=fsdp", "strategy.cpu_offload=true", "strategy.meta_init=true"],
    # fused AdamW (the GPU default) clipped under bf16-mixed, which Lightning alone refuses
    "ddp_bf16_mixed": ["strategy=ddp", "trainer.precision=bf16-mixed", "optimizer.fused=true", "logger=[]"],
    # rowwise float8 linears fail under inference mode, Lightning's validation context on one process (and on
    # NCCL): with float8 validation runs under no_grad (test_float8_parity.py samples under tp and fsdp)
    "auto_float8_rowwise": ["float8=rowwise", "float8_filter=all"],
}
COMMON = [
    "trainer.max_steps=3",
    "trainer.val_check_interval=2",
]  # TINY keeps validation before and the sample


@pytest.mark.parametrize("case", sorted(CASES))
def test_trains_validates_samples_and_exports(case, tmp_path, data_cache):
    run = tmp_path / "run"
    proc = train(*COMMON, *CASES[case], "trainer.devices=1", cwd=tmp_path, cache=data_cache, run_dir=run)
    out = proc.stdout + proc.stderr
    assert "\nsample:\n" in out and "Traceback" not in out
    assert "final metrics:   {'val/loss'" in out
    if (run / "csv").exists():
        with open(run / "csv" / "metrics.csv") as f:
            assert max(int(r["step"]) for r in csv.DictReader(f) if r["val/loss"]) == 3  # after the 3rd step
    export(
        [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"out_dir={tmp_path / 'hf'}"]
    )  # in this process
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow  # a duplicate of test_sweeps.py::test_debug_presets_run_with_the_defaults[fdr]
def test_fast_dev_run_with_the_defaults(tmp_path, data_cache):
    """A smoke test as users write it: the defaults (validation before, sample at the end) plus fast_dev_run.

    Slow because it duplicates test_sweeps.py::test_debug_presets_run_with_the_defaults[fdr]: `debug=fdr` sets
    trainer.fast_dev_run=true (and task_name) on the same TINY defaults, and that test asserts the sample too."""
    proc = train(
        "trainer.fast_dev_run=true",
        cwd=tmp_path,
        cache=data_cache,
        run_dir=tmp_path / "run",
    )
    assert "\nsample:\n" in proc.stdout + proc.stderr
