"""The universal checkpoint: a run started under strategy A at world size m continues under B at n exactly.

One chain of cross-strategy resumes, 2 optimizer steps per link, each link a different strategy and world size:

    ddp@2 -> deepspeed ZeRO-3@1 -> fsdp@2 -> ddp_sharded@1 -> deepspeed ZeRO-2@2 -> ddp@1   (steps 2, 4, ..., 12)

and a branch: ddp_sharded@1's checkpoint converted offline to a DeepSpeed ZeRO-1 folder for 2 ranks, which
DeepSpeed then loads natively (ZeRO-1 under DeepSpeed and `parallama-ckpt convert format=deepspeed`).

Every link's end is compared with one uninterrupted ddp run at 2 ranks at the same step (weights and AdamW
moments to 1e-5, step and token counters, the running hash of trained samples), and the chain's index logs
together must be the reference's samples in the same order, each once. The global batch stays 4 (2 ranks x 2 or
1 x 4), so the data order and the optimization do not depend on the world size; the LR is constant (a run's
schedule then does not depend on its length) and low enough that fp32 reduction-order noise between 1 and 2
ranks stays below 1e-5 (at 3e-3 Adam amplifies it to ~1.6e-5).

Covering subset of the 5 x 5 strategies x {(2,1), (1,2)}: every checkpoint reader (a Lightning file from ddp and
from ddp_sharded, DeepSpeed ZeRO-2 and ZeRO-3 folders, FSDP's DCP folder) is a source once, every loader (plain
module, ZeroRedundancyOptimizer, DeepSpeed stage 2 and 3, FSDP2) a destination once, and the world size changes in
both directions. A chain (one run per link) instead of separate 6 + 6 step pairs halves the runs; a broken link
still fails on its own step. Same-strategy resumes (Lightning's native path) are covered by test_strategies.py and
test_resume.py.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import run_cli, train
from corruption import flip_a_tensor_byte

from parallama.checkpoint import integrity, universal
from parallama.checkpoint.formats import INFO_KEY
from parallama.checkpoint.resume import check_model_matches, resolve_ckpt_path
from parallama.cli.ckpt import main as convert_main
from parallama.cli.evaluate import main as eval_main
from parallama.cli.export import main as export_main
from parallama.errors import ConfigError

CONSTANT_LR = ["scheduler.warmup_steps=0", "scheduler.min_lr_ratio=1", "optimizer.lr=3e-4"]
QUIET = ["trainer.limit_val_batches=0", "validate_before_training=false", "sample.max_new_tokens=0"]
STRATEGY = {
    "ddp": ["strategy=ddp"],
    "ddp_sharded": ["strategy=ddp_sharded"],
    "ds1": ["strategy=deepspeed", "strategy.stage=1"],
    "ds2": ["strategy=deepspeed", "strategy.stage=2"],
    "ds3": ["strategy=deepspeed", "strategy.stage=3"],
    "fsdp": ["strategy=fsdp"],
}
CHAIN = [("ddp", 2), ("ds3", 1), ("fsdp", 2), ("ddp_sharded", 1), ("ds2", 2), ("ddp", 1)]
LINK_STEPS = 2
LINKS = [(i, *CHAIN[i - 1], *CHAIN[i]) for i in range(1, len(CHAIN))]  # (link, a, m, b, n)
STEP_CHECKPOINTS = [  # the references keep a checkpoint every LINK_STEPS steps
    "callbacks.model_checkpoint.monitor=null",
    "callbacks.model_checkpoint.save_top_k=-1",
    f"+callbacks.model_checkpoint.every_n_train_steps={LINK_STEPS}",
]
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


def _name(link: int) -> str:
    strategy, world = CHAIN[link]
    return f"{link}-{strategy}{world}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """The chain and the uninterrupted reference (ddp at 2 ranks), once for all tests."""
    tmp = tmp_path_factory.mktemp("universal")
    out = {"dir": tmp, "log": {}}
    steps = LINK_STEPS * len(CHAIN)
    _run("ref", "ddp", 2, steps, tmp, data_cache, *STEP_CHECKPOINTS)
    for link, (strategy, world) in enumerate(CHAIN):
        resume = [f"ckpt_path={tmp / _name(link - 1) / 'checkpoints' / 'last.ckpt'}"] if link else []
        proc = _run(_name(link), strategy, world, LINK_STEPS * (link + 1), tmp, data_cache, *resume)
        out["log"][link] = proc.stdout + proc.stderr
    return out


def _assert_at_reference_step(got, want, step: int) -> None:
    assert got.client["global_step"] == want.client["global_step"] == step
    assert got.client["tokens_seen"] == want.client["tokens_seen"]
    for name, tensor in want.model.items():
        torch.testing.assert_close(got.model[name].float(), tensor.float(), atol=TOLERANCE, rtol=0)
    assert set(got.optimizer["state"]) == set(want.optimizer["state"]) == set(want.model)
    for name, moments in want.optimizer["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                got.optimizer["state"][name][key], moments[key], atol=TOLERANCE, rtol=0
            )
        assert float(got.optimizer["state"][name]["step"]) == float(moments["step"]) == step
    assert got.client["TextDataModule"]["trained_hash"] == want.client["TextDataModule"]["trained_hash"]
    assert got.client["TextDataModule"]["trained_samples"] == step * 4


def _assert_same_state(after, before) -> None:
    """Bit for bit: fp32 weights, AdamW moments and Lightning's state (loops, LR schedule, data position,
    tokenizer, W&B run id); only the writer's record differs."""
    assert after.model.keys() == before.model.keys()
    assert all(torch.equal(after.model[k], before.model[k].float()) for k in before.model)
    for name, moments in before.optimizer["state"].items():
        assert all(
            torch.equal(after.optimizer["state"][name][k], moments[k]) for k in ("exp_avg", "exp_avg_sq")
        )
    assert {k: v for k, v in after.client.items() if k != INFO_KEY} == {
        k: v for k, v in before.client.items() if k != INFO_KEY
    }


def _indices(path) -> list[int]:
    return [i for line in path.read_text().splitlines() for i in json.loads(line)["indices"]]


@pytest.mark.multiprocess
@pytest.mark.parametrize("link,a,m,b,n", LINKS, ids=[f"{a}{m}-{b}{n}" for _, a, m, b, n in LINKS])
def test_a_run_continues_under_another_strategy_and_world_size(runs, link, a, m, b, n):
    tmp, step = runs["dir"], LINK_STEPS * (link + 1)
    assert f"resuming a {STRATEGY[a][0].split('=')[1]} checkpoint (world size {m})" in runs["log"][link]
    got = universal.read(tmp / _name(link) / "checkpoints" / "last.ckpt")
    want = universal.read(tmp / "ref" / "checkpoints" / f"step{step:07d}.ckpt")
    _assert_at_reference_step(got, want, step)

    # The data position: the same global samples in the same order, each once, and the same running hash.
    trained = [i for k in range(link + 1) for i in _indices(tmp / f"{_name(k)}.jsonl")]
    assert trained == _indices(tmp / "ref.jsonl")[: len(trained)]
    assert len(set(trained)) == len(trained) == step * 4
    assert "samples per optimizer step" not in runs["log"][link]  # the global batch stayed 4: no warning


@pytest.mark.multiprocess
def test_convert_writes_any_checkpoint_as_a_file_or_a_dcp_folder_with_the_same_state(runs, tmp_path):
    """parallama-ckpt convert, offline: a DeepSpeed ZeRO-3 folder to a file, and that file to a DCP folder."""
    source = runs["dir"] / _name(1) / "checkpoints" / "last.ckpt"  # ds3@1 at step 4
    run_cli(
        "parallama.cli.ckpt", f"src={source}", f"out={tmp_path / 'one.ckpt'}", "format=file", cwd=tmp_path
    )
    run_cli(
        "parallama.cli.ckpt",
        f"src={tmp_path / 'one.ckpt'}",
        f"out={tmp_path / 'dcp'}",
        "format=dcp",
        cwd=tmp_path,
    )
    before = universal.read(source)
    assert before.client["global_step"] == 2 * LINK_STEPS
    for converted in (tmp_path / "one.ckpt", tmp_path / "dcp"):
        _assert_same_state(universal.read(converted), before)
    refused = run_cli(
        "parallama.cli.ckpt", f"src={source}", f"out={tmp_path / 'one.ckpt'}", cwd=tmp_path, check=False
    )
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0
    assert "exists" in refused.stderr


@pytest.mark.multiprocess
def test_convert_writes_a_deepspeed_folder_that_deepspeed_resumes_natively(runs, tmp_path, data_cache):
    """ddp_sharded@1's step-8 file -> a ZeRO-1 folder for 2 ranks, written by DeepSpeed: the same state read
    back, recorded as DeepSpeed's own, and a ZeRO-1@2 run resumes it natively (no universal path) to step 10
    equal to the uninterrupted reference. The converting run clips nothing (it has no trainer config), so this
    also shows that a DeepSpeed resume clips as configured, not as the checkpoint's writer did."""
    source = runs["dir"] / _name(3) / "checkpoints" / "last.ckpt"
    out = tmp_path / "zero1"
    args = [f"src={source}", f"out={out}", "format=deepspeed", "devices=2", "stage=1"]
    run_cli("parallama.cli.ckpt", *args, cwd=tmp_path)
    assert universal.writer_info(out) == {
        "format": "deepspeed",
        "strategy": "deepspeed",
        "world_size": 2,
        "stage": 1,
        "offload": False,
        "precision": "32-true",
        "dims": {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1},
    }
    before = universal.read(source)
    _assert_same_state(universal.read(out), before)

    # ZeRO-3 on one rank in bf16 with optimizer and parameters offloaded (DeepSpeedCPUAdam): DeepSpeed keeps bf16
    # weights in the module and the fp32 masters beside them; those and the moments are still the source's.
    bf16 = tmp_path / "zero3_bf16_offload"
    args = [
        f"src={source}",
        f"out={bf16}",
        "format=deepspeed",
        "devices=1",
        "stage=3",
        "precision=bf16-mixed",
        "offload=true",
    ]
    run_cli("parallama.cli.ckpt", *args, cwd=tmp_path)
    info = universal.writer_info(bf16)
    assert (info["stage"], info["offload"], info["precision"]) == (3, True, "bf16-mixed")
    _assert_same_state(universal.read(bf16), before)

    step = LINK_STEPS * 5
    proc = _run("zero1", "ds1", 2, step, tmp_path, data_cache, f"ckpt_path={out}")
    assert "resuming a" not in proc.stdout + proc.stderr  # DeepSpeed's own loading
    got = universal.read(tmp_path / "zero1" / "checkpoints" / "last.ckpt")
    _assert_at_reference_step(
        got, universal.read(runs["dir"] / "ref" / "checkpoints" / f"step{step:07d}.ckpt"), step
    )
    trained = [i for k in range(4) for i in _indices(runs["dir"] / f"{_name(k)}.jsonl")]
    trained += _indices(tmp_path / "zero1.jsonl")
    assert trained == _indices(runs["dir"] / "ref.jsonl")[: len(trained)] and len(trained) == step * 4


# The chain's links by the format they wrote: a ddp file, DeepSpeed folders at 1 and 2 ranks, FSDP's DCP folder.
CORRUPTED = {"ddp2-file": 0, "ds3-folder": 1, "fsdp2-dcp": 2, "ds2@2-folder": 4}


@pytest.mark.multiprocess
@pytest.mark.parametrize("link", CORRUPTED.values(), ids=CORRUPTED)
def test_a_flipped_tensor_byte_is_caught_by_resume_eval_export_and_convert(runs, link, tmp_path, capsys):
    """Every format a run writes carries checksums, every rank's files hashed where they were written (the chain's
    own checkpoints check); one byte flipped inside a tensor of a copy is refused, naming the file, by what a
    resume reads first (ckpt_path resolved, the config check), by parallama-eval, -export and -ckpt convert."""
    source = runs["dir"] / _name(link) / "checkpoints" / "last.ckpt"
    assert integrity.has_checksums(source) and integrity.problem(source) is None
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    if source.is_dir():
        shutil.copytree(source, ckpt)
    else:
        ckpt.parent.mkdir(parents=True)
        for file in (source, integrity.sidecar(source)):
            shutil.copy2(file, ckpt.parent / file.name)
    line = f"checkpoint {flip_a_tensor_byte(ckpt)} is corrupt: its sha256 differs from the one "
    for read in (
        lambda: resolve_ckpt_path(str(ckpt), str(tmp_path / "new")),
        lambda: check_model_matches(str(ckpt), {}, strict=False),
        lambda: resolve_ckpt_path("last", str(tmp_path / "run")),  # its only checkpoint: none is intact
    ):
        with pytest.raises(ConfigError, match=re.escape(line)):
            read()
    for main, args in [
        (eval_main, [f"ckpt_path={ckpt}"]),
        (export_main, [f"ckpt_path={ckpt}", f"out_dir={tmp_path / 'hf'}"]),
        (convert_main, ["convert", f"src={ckpt}", f"out={tmp_path / 'converted'}"]),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(args)
        errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("error:")]
        assert exited.value.code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {line}"), errors
    assert not (tmp_path / "hf").exists() and not (tmp_path / "converted").exists()
