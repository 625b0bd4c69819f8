"""DeepSpeed ZeRO <-> universal state (parallama.checkpoint.zero), on real multi-process DeepSpeed runs (gloo).

The running-engine functions are driven from inside training by tests/distributed/zero_probe.py (a Lightning callback added
with a Hydra override); each run is its own subprocess, as Lightning's ddp re-executes the command line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import train

import parallama
from parallama.checkpoint.formats import DEEPSPEED_KEYS
from parallama.checkpoint.zero import read_zero_checkpoint

pytestmark = pytest.mark.multiprocess
TESTS = Path(__file__).parent
RUN = [
    "strategy=deepspeed",
    "trainer.precision=32-true",
    "trainer.max_steps=5",
    "trainer.limit_val_batches=0",
    "validate_before_training=false",
    "sample.max_new_tokens=0",
    "logger=none",
    "callbacks=none",
    "seed=7",
    "+callbacks.probe._target_=zero_probe.ZeroProbe",
]


def run(tmp: Path, cache: Path, *args: str) -> Path:
    """Train with the probe writing into <tmp>/out; returns that folder."""
    src = Path(parallama.__file__).parents[1]  # the parallama under test, and the probe beside this file
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), str(src), os.environ.get("PYTHONPATH", "")])}
    train(
        *RUN, f"+callbacks.probe.out={tmp / 'out'}", *args, cwd=tmp, cache=cache, run_dir=tmp / "run", env=env
    )
    return tmp / "out"


def load(path: Path) -> tuple[dict, dict]:
    return torch.load(path, weights_only=True)


def assert_same_state(actual: tuple[dict, dict], expected: tuple[dict, dict], tol: float = 1e-5) -> None:
    """Same weights, moments and steps (within `tol`), same param groups: names and the hyper-parameters both
    optimizers have (DeepSpeedCPUAdam has no `foreach`, torch's AdamW no `bias_correction`)."""
    (model, optimizer), (model_ref, optimizer_ref) = actual, expected
    assert model.keys() == model_ref.keys()
    for name in model_ref:
        torch.testing.assert_close(model[name], model_ref[name], rtol=tol, atol=tol, msg=name)
    assert optimizer["state"].keys() == optimizer_ref["state"].keys()
    for name, state in optimizer_ref["state"].items():
        assert optimizer["state"][name].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(
                optimizer["state"][name][key], value, rtol=tol, atol=tol, msg=f"{name} {key}"
            )
    assert len(optimizer["param_groups"]) == len(optimizer_ref["param_groups"])
    for group, ref in zip(optimizer["param_groups"], optimizer_ref["param_groups"]):
        assert set(group["params"]) == set(ref["params"])
        assert {k: v for k, v in group.items() if k in ref} == {k: v for k, v in ref.items() if k in group}


@pytest.fixture(scope="module")
def zero2_two_ranks(tmp_path_factory, data_cache) -> tuple[Path, Path]:
    """2 ranks, ZeRO-2, micro-batch 4, 5 steps; the probe writes a checkpoint + live state after step 3 and at
    the end. Returns (probe folder, universal state file read offline from the step-3 checkpoint)."""
    tmp = tmp_path_factory.mktemp("zero2")
    out = run(tmp, data_cache, "trainer.devices=2", "data.batch_size=4", "+callbacks.probe.save=true")
    model, optimizer, _ = read_zero_checkpoint(out / "ckpt_at")
    torch.save((model, optimizer), tmp / "universal_step3.pt")
    return out, tmp / "universal_step3.pt"


def test_offline_read_equals_the_running_engine(zero2_two_ranks):
    """A 2-rank ZeRO-2 checkpoint read offline equals, exactly, what the engine that wrote it holds (gathered
    live with the tensor-fragment API): fp32 weights, AdamW moments, step and param groups, after step 3 and
    after step 5; the client state is Lightning's, without DeepSpeed's own keys."""
    out, _ = zero2_two_ranks
    for ckpt, live, step in [("ckpt_at", "before.pt", 3), ("ckpt_end", "end.pt", 5)]:
        model, optimizer, client = read_zero_checkpoint(out / ckpt)
        assert_same_state((model, optimizer), load(out / live), tol=0)
        assert {s["step"].item() for s in optimizer["state"].values()} == {step}
        assert client["global_step"] == step and client["tokens_seen"] > 0 and client["tokenizer"]
        assert "hyper_parameters" in client and not set(DEEPSPEED_KEYS) & set(client)


@pytest.mark.slow  # the same loads as test_universal_resume's ds2/ds3 cases, checked step by step (~50 s)
@pytest.mark.parametrize("stage", [2, 3])
def test_one_rank_continues_the_two_rank_run(stage, zero2_two_ranks, tmp_path, data_cache):
    """1 rank (micro-batch 8 = the same global batch) trains 3 steps with other betas and weight decay, then
    loads the 2-rank ZeRO-2 step-3 state and trains steps 4-5: its state then equals the 2-rank run's own
    steps 4-5 within 1e-5. Before the load the two differ (so the check can fail); continuing exactly needs the
    master and working weights, both moments, the step count (bias correction) and the groups' betas and weight
    decay to be loaded, into ZeRO-2 (same layout) and ZeRO-3 (parameters partitioned too)."""
    out_ref, universal = zero2_two_ranks
    out = run(
        tmp_path,
        data_cache,
        "trainer.devices=1",
        "data.batch_size=8",
        f"strategy.stage={stage}",
        "optimizer.betas=[0.5,0.6]",
        "optimizer.weight_decay=0.5",
        f"+callbacks.probe.load={universal}",
    )
    model, _ = load(out / "before.pt")
    reference_model, _ = load(universal)
    assert max((model[n] - reference_model[n]).abs().max() for n in model) > 1e-3
    assert_same_state(load(out / "after.pt"), load(universal), tol=0)
    assert_same_state(load(out / "end.pt"), load(out_ref / "end.pt"))


def test_zero3_bf16_offload_before_the_first_step(zero2_two_ranks, tmp_path, data_cache):
    """2 ranks, ZeRO-3, bf16-mixed, optimizer offloaded to DeepSpeedCPUAdam: loading before the first step
    (AdamW state does not exist yet and is created) reads back exactly what was loaded, training goes on from
    it, and the run's 2-rank ZeRO-3 checkpoint read offline equals its live state."""
    _, universal = zero2_two_ranks
    out = run(
        tmp_path,
        data_cache,
        "trainer.devices=2",
        "trainer.max_steps=2",
        "trainer.precision=bf16-mixed",
        "strategy.stage=3",
        "strategy.offload_optimizer=true",
        "+callbacks.probe.at=0",
        f"+callbacks.probe.load={universal}",
    )
    assert load(out / "before.pt")[1]["state"] == {}
    assert_same_state(load(out / "after.pt"), load(universal), tol=0)
    model, optimizer, client = read_zero_checkpoint(out / "ckpt_end")
    assert_same_state((model, optimizer), load(out / "end.pt"), tol=0)
    assert {s["step"].item() for s in optimizer["state"].values()} == {5} and client["global_step"] == 2
