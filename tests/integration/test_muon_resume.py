"""optimizer=muon resumes exactly: a 2-step run resumed to 4 equals a 4-step run (Lightning's native path, one
process; Muon's and AdamW's LRs differ, a warmup spans the resume), and an fsdp checkpoint (2 ranks, a DCP folder
of sharded Muon momenta and AdamW moments) continues as one process (the universal path: optimizer state keyed by
parameter name) as one process trains all 4 steps, and one process's checkpoint continues under fsdp. A resume with another `optimizer.adamw_lr` takes it for the
AdamW side only. model_parallel tp=2 resumes its own DCP checkpoint (sharded momenta), ddp_sharded its consolidated file, bit for
bit."""

from __future__ import annotations

import pytest
import torch
from conftest import train, weights

from parallama.checkpoint import universal

RECIPE = [
    "optimizer=muon",
    "optimizer.lr=3e-4",
    "optimizer.adamw_lr=1e-3",
    "scheduler=constant",
    "scheduler.warmup_steps=1",
    "trainer.precision=32-true",
    "trainer.limit_val_batches=0",
    "validate_before_training=false",
    "sample.max_new_tokens=0",
    "seed=7",
]


def run(tmp_path, cache, name: str, steps: int, *args: str):
    proc = train(
        *RECIPE, f"trainer.max_steps={steps}", *args, cwd=tmp_path, cache=cache, run_dir=tmp_path / name
    )
    return tmp_path / name / "checkpoints" / "last.ckpt", proc.stdout + proc.stderr


def weights_of(checkpoint) -> dict:
    """A Lightning file's or a DCP folder's weights."""
    return {k: v.float() for k, v in universal.read(checkpoint).model.items()}


def assert_same_weights(got: dict, want: dict, tolerance: float) -> None:
    assert want and got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=tolerance, msg=name)
    print(f"max weight difference {max((got[k] - want[k]).abs().max().item() for k in want):.3g}")


def test_a_resumed_muon_run_equals_an_uninterrupted_one(tmp_path, data_cache):
    straight, _ = run(tmp_path, data_cache, "straight", 4)
    half, _ = run(tmp_path, data_cache, "half", 2)
    resumed, _ = run(tmp_path, data_cache, "resumed", 4, f"ckpt_path={half}")
    assert_same_weights(weights(resumed), weights(straight), 1e-6)
    assert max((weights(half)[k] - weights(straight)[k]).abs().max() for k in weights(half)) > 1e-4

    # a resume takes this run's LRs, each side its own (CausalLM._apply_configured_lr)
    changed, _ = run(tmp_path, data_cache, "changed", 3, f"ckpt_path={half}", "optimizer.adamw_lr=2e-3")
    schedulers = torch.load(changed, map_location="cpu", weights_only=True)["lr_schedulers"]
    assert schedulers[0]["base_lrs"] == [3e-4, 2e-3, 2e-3]  # Muon's matrices; AdamW's matrices and norms


@pytest.mark.multiprocess
def test_an_fsdp_muon_checkpoint_continues_as_one_process(tmp_path, data_cache):
    """Newton-Schulz in fp32: in bf16 the layouts' gradient reductions differ visibly (tests/distributed/
    test_recipe.py)."""
    fp32 = "optimizer.ns_dtype=float32"
    straight, _ = run(tmp_path, data_cache, "straight", 4, fp32, "data.batch_size=8")
    sharded = ["strategy=fsdp", "trainer.devices=2", "data.batch_size=4"]
    half, _ = run(tmp_path, data_cache, "fsdp", 2, fp32, *sharded)
    resumed, output = run(tmp_path, data_cache, "resumed", 4, fp32, "data.batch_size=8", f"ckpt_path={half}")
    assert "resuming a fsdp checkpoint (world size 2) under auto at world size 1" in output
    assert_same_weights(weights(resumed), weights(straight), 1e-5)
    # and the other way: one process's file continues sharded (torch's full optimizer state dict into FSDP2)
    half, _ = run(tmp_path, data_cache, "auto", 2, fp32, "data.batch_size=8")
    resumed, output = run(tmp_path, data_cache, "resharded", 4, fp32, *sharded, f"ckpt_path={half}")
    assert "resuming a auto checkpoint (world size 1) under fsdp at world size 2" in output
    assert_same_weights(weights_of(resumed), weights(straight), 1e-5)


@pytest.mark.multiprocess
def test_a_tensor_parallel_muon_run_resumes_natively(tmp_path, data_cache):
    """model_parallel tp=2 writes DCP (Muon's momenta DTensors sharded on tp) and loads it back through torch's
    distributed optimizer state dict, whose set-up steps the optimizer once at lr 0 (a collective per matrix)."""
    layout = ["strategy=model_parallel", "strategy.tp=2", "trainer.devices=2", "data.batch_size=8"]
    straight, _ = run(tmp_path, data_cache, "straight", 4, *layout)
    half, _ = run(tmp_path, data_cache, "half", 2, *layout)
    resumed, output = run(tmp_path, data_cache, "resumed", 4, *layout, f"ckpt_path={half}")
    assert half.is_dir() and "resuming a" not in output  # DCP, loaded natively (not the universal path)
    assert_same_weights(weights_of(resumed), weights_of(straight), 1e-6)


@pytest.mark.multiprocess
def test_a_ddp_sharded_muon_run_resumes_natively(tmp_path, data_cache):
    """ZeroRedundancyOptimizer (ddp_sharded) builds one MuonAdamW per rank over its own whole parameters and
    consolidates their states into the checkpoint's one."""
    layout = ["strategy=ddp_sharded", "trainer.devices=2", "data.batch_size=4"]
    straight, _ = run(tmp_path, data_cache, "straight", 4, *layout)
    half, _ = run(tmp_path, data_cache, "half", 2, *layout)
    resumed, output = run(tmp_path, data_cache, "resumed", 4, *layout, f"ckpt_path={half}")
    assert "resuming a" not in output
    assert_same_weights(weights(resumed), weights(straight), 1e-6)
