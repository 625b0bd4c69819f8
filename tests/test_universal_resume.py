"""The universal checkpoint: a run started under strategy A at world size m continues under B at n exactly.

Each case trains 6 steps under A at m, resumes under B at n to step 12, and is compared with 12 uninterrupted
steps at n (weights and AdamW moments to 1e-5, the same global samples by index log and running hash). The
global batch stays 4 (2 ranks x 2, or 1 x 4), the LR is constant (a run's schedule then does not depend on
its length) and low enough that fp32 reduction-order noise stays below 1e-5 (at 3e-3 Adam amplifies it to
~1.6e-5 between two uninterrupted runs at 1 and 2 ranks).

Covering subset of the 5 x 5 strategies x {(2,1), (1,2)}: every checkpoint reader (a Lightning file from ddp
and from ddp_sharded, DeepSpeed ZeRO-2 and ZeRO-3 folders, FSDP's DCP folder) is a source once, every loader
(plain module, ZeroRedundancyOptimizer, DeepSpeed stage 2 and 3, FSDP2) a destination once, and both
directions of the world size change occur. Same-strategy resumes (Lightning's native path) are covered by
test_strategies.py and test_resume.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli, train

from parallama.parallel import universal

CONSTANT_LR = ["scheduler.warmup_steps=0", "scheduler.min_lr_ratio=1", "optimizer.lr=3e-4"]
QUIET = ["trainer.limit_val_batches=0", "validate_before_training=false", "sample.max_new_tokens=0"]
STRATEGY = {
    "ddp": ["strategy=ddp"],
    "ddp_sharded": ["strategy=ddp_sharded"],
    "ds2": ["strategy=deepspeed", "strategy.stage=2"],
    "ds3": ["strategy=deepspeed", "strategy.stage=3"],
    "fsdp": ["strategy=fsdp"],
}
CASES = [("ddp", 2, "ds3", 1), ("ds2", 2, "fsdp", 1), ("fsdp", 2, "ddp_sharded", 1), ("ds3", 1, "ddp", 2)]
CASES += [("ddp_sharded", 1, "ds2", 2)]
TOLERANCE = 1e-5


def _run(name: str, strategy: str, world: int, steps: int, tmp, cache, *extra: str):
    args = [
        *CONSTANT_LR,
        *QUIET,
        *STRATEGY[strategy],
        f"trainer.devices={world}",
        f"data.batch_size={4 // world}",
    ]
    args += [f"trainer.max_steps={steps}", f"data.index_log={tmp / (name + '.jsonl')}", *extra]
    return train(*args, cwd=tmp, cache=cache, run_dir=tmp / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """Every case's halves and the uninterrupted reference at each world size (ddp), once for all tests."""
    tmp = tmp_path_factory.mktemp("universal")
    out = {"dir": tmp, "log": {}}
    for world in (1, 2):
        _run(f"ref{world}", "ddp", world, 12, tmp, data_cache)
    for a, m, b, n in CASES:
        first, second = f"{a}{m}", f"{a}{m}_{b}{n}"
        _run(first, a, m, 6, tmp, data_cache)
        ckpt = tmp / first / "checkpoints" / "last.ckpt"
        proc = _run(second, b, n, 12, tmp, data_cache, f"ckpt_path={ckpt}")
        out["log"][second] = proc.stdout + proc.stderr
    return out


def _state(run_dir) -> universal.UniversalState:
    return universal.read(run_dir / "checkpoints" / "last.ckpt")


def _indices(path) -> list[int]:
    return [i for line in path.read_text().splitlines() for i in json.loads(line)["indices"]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("a,m,b,n", CASES, ids=[f"{a}{m}-{b}{n}" for a, m, b, n in CASES])
def test_a_run_continues_under_another_strategy_and_world_size(runs, a, m, b, n):
    tmp, second = runs["dir"], f"{a}{m}_{b}{n}"
    assert f"resuming a {STRATEGY[a][0].split('=')[1]} checkpoint (world size {m})" in runs["log"][second]
    got, want = _state(tmp / second), _state(tmp / f"ref{n}")
    assert got.client["global_step"] == want.client["global_step"] == 12
    assert got.client["tokens_seen"] == want.client["tokens_seen"]
    for name, tensor in want.model.items():
        torch.testing.assert_close(got.model[name].float(), tensor.float(), atol=TOLERANCE, rtol=0)
    assert set(got.optimizer["state"]) == set(want.optimizer["state"]) == set(want.model)
    for name, moments in want.optimizer["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                got.optimizer["state"][name][key], moments[key], atol=TOLERANCE, rtol=0
            )
        assert float(got.optimizer["state"][name]["step"]) == float(moments["step"]) == 12

    # The data position: the same global samples in the same order, each once, and the same running hash.
    trained = _indices(tmp / f"{a}{m}.jsonl") + _indices(tmp / f"{second}.jsonl")
    assert trained == _indices(tmp / f"ref{n}.jsonl")
    assert len(set(trained)) == len(trained) == 12 * 4
    position = got.client["TextDataModule"]
    assert position["trained_hash"] == want.client["TextDataModule"]["trained_hash"]
    assert position["trained_samples"] == 48
    assert "samples per optimizer step" not in runs["log"][second]  # the global batch stayed 4: no warning


@pytest.mark.multiprocess
def test_convert_writes_any_checkpoint_as_a_file_or_a_dcp_folder_with_the_same_state(runs, tmp_path):
    """parallama-ckpt convert, offline: a DeepSpeed ZeRO-3 folder to a file, and that file to a DCP folder."""
    source = runs["dir"] / "ds31" / "checkpoints" / "last.ckpt"
    run_cli("parallama.convert", f"src={source}", f"out={tmp_path / 'one.ckpt'}", "format=file", cwd=tmp_path)
    run_cli(
        "parallama.convert",
        f"src={tmp_path / 'one.ckpt'}",
        f"out={tmp_path / 'dcp'}",
        "format=dcp",
        cwd=tmp_path,
    )
    before = universal.read(source)
    for converted in (tmp_path / "one.ckpt", tmp_path / "dcp"):
        after = universal.read(converted)
        assert after.model.keys() == before.model.keys()
        assert all(torch.equal(after.model[k].float(), before.model[k].float()) for k in before.model)
        for name, moments in before.optimizer["state"].items():
            assert all(
                torch.equal(after.optimizer["state"][name][k], moments[k]) for k in ("exp_avg", "exp_avg_sq")
            )
        assert after.client["global_step"] == 6
    refused = run_cli(
        "parallama.convert", f"src={source}", f"out={tmp_path / 'one.ckpt'}", cwd=tmp_path, check=False
    )
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0
    assert "exists" in refused.stderr
