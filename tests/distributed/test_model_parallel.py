"""strategy=model_parallel on CPU (gloo): each layout trains like one process, and a run resumes across layouts.

Parity: one process at micro-batch 8 (the reference) against, for 3 optimizer steps with gradient clipping on,

    tp=2 (2 ranks x 8)   tp=2 + sequence parallel (2 x 8)   dp_shard=2 x tp=2 (4 x 4, activation checkpointing)
    dp_replicate=2 x dp_shard=2 (HSDP, 4 x 2)

the same global batch 8: weights after 3 steps (through parallama-export, to 1e-5) and train/loss at every step
(metrics.csv); every run also validates and samples at the end (the TP inference paths), and all sample the
same text.

Resume: three links from those runs' step-3 checkpoints to step 6, each equal to the reference's step 6
(weights and AdamW moments to 1e-5, counters, the data position's running hash):

    tp=2 (DCP) -> strategy=fsdp on 1 process                        the universal path from a TP checkpoint
    dp_shard=2 x tp=2 (DCP) -> model_parallel dp_shard=2 on 2 ranks   DCP's own resharding (same strategy)
    the reference (one process, a Lightning file) -> tp=2 + SP        the universal path into TP DTensors

The LR is constant (a run's schedule then does not depend on its length) and low enough that reduction-order
noise stays far below 1e-5 after Adam.
"""

from __future__ import annotations

import csv
import math

import pytest
import torch
from conftest import train
from safetensors.torch import load_file

from parallama.checkpoint import universal
from parallama.cli.export import main as export_hf
from parallama.cli.generate import generate_text
from parallama.training.report import SAMPLE

pytestmark = pytest.mark.multiprocess

COMMON = [
    "scheduler.warmup_steps=0",
    "scheduler.min_lr_ratio=1",
    "optimizer.lr=3e-4",
    "trainer.precision=32-true",
    "trainer.gradient_clip_val=0.5",  # the tiny model's gradient norm is ~1.5: every step clips
    "seed=7",
]
QUIET = ["trainer.limit_val_batches=0", "validate_before_training=false", "sample.max_new_tokens=0"]
MP = "strategy=model_parallel"
PARITY = {  # name: (mesh sizes, per-rank batch, more overrides); every layout trains on global batch 8
    "tp": ({"tp": 2}, 8, []),
    "tp_sp": ({"tp": 2}, 8, ["strategy.sequence_parallel=true"]),
    "fsdp_tp": ({"dp_shard": 2, "tp": 2}, 4, ["activation_checkpointing=true"]),
    "hsdp": ({"dp_replicate": 2, "dp_shard": 2}, 2, []),
}
RESUMES = {  # name: (source run, ranks, overrides, how it loads)
    "tp_to_fsdp1": ("tp", 1, ["strategy=fsdp", "data.batch_size=8"], "universal"),
    "fsdp_tp_to_dp_shard2": ("fsdp_tp", 2, [MP, "strategy.dp_shard=2", "data.batch_size=4"], "native"),
    "file_to_tp_sp": (
        "ref",
        2,
        [MP, "strategy.tp=2", "strategy.sequence_parallel=true", "data.batch_size=8"],
        "universal",
    ),
}
STEPS, TOLERANCE = 3, 1e-5


def train_matrix(tmp, cache, common: list[str], layouts: dict, resumes: dict) -> dict[str, str]:
    """{run: its output}: the reference (one process at batch 8, 2 x STEPS steps, a checkpoint every STEPS), each
    layout (`{name: (mesh sizes, per-rank batch, overrides)}`, STEPS steps) and each resume (`{name: (source run,
    ranks, overrides, how it loads)}`: from the source's step STEPS to 2 x STEPS)."""
    logs = {}

    def run(name, ranks, steps, *args):
        proc = train(
            *common,
            f"trainer.devices={ranks}",
            f"trainer.max_steps={steps}",
            *args,
            cwd=tmp,
            cache=cache,
            run_dir=tmp / name,
            timeout=600,
        )
        logs[name] = proc.stdout + proc.stderr

    every_n_steps = [
        "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.save_top_k=-1",
        f"+callbacks.model_checkpoint.every_n_train_steps={STEPS}",
    ]
    run("ref", 1, 2 * STEPS, "data.batch_size=8", *every_n_steps)
    for name, (sizes, batch, args) in layouts.items():
        sizes_args = (f"strategy.{k}={v}" for k, v in sizes.items())
        run(name, math.prod(sizes.values()), STEPS, MP, *sizes_args, f"data.batch_size={batch}", *args)
    for name, (source, ranks, args, _) in resumes.items():
        ckpt = tmp / "ref" / "checkpoints" / f"step{STEPS:07d}.ckpt" if source == "ref" else None
        ckpt = ckpt or tmp / source / "checkpoints" / "last.ckpt"
        run(name, ranks, 2 * STEPS, *args, *QUIET, f"ckpt_path={ckpt}")
    return logs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """The reference (6 steps, a checkpoint every 3), the parity runs (3 steps) and the resumes (to step 6)."""
    tmp = tmp_path_factory.mktemp("model_parallel")
    return {"dir": tmp, "log": train_matrix(tmp, data_cache, COMMON, PARITY, RESUMES)}


def assert_same_state(got, want, step: int, atol: float = TOLERANCE, batch: int = 8) -> None:
    """Two checkpoints (universal.read) at `step` hold the same training: counters, weights and AdamW moments (to
    `atol`) and the data position's running hash over step x `batch` (the global batch) samples."""
    assert got.client["global_step"] == want.client["global_step"] == step
    assert got.client["tokens_seen"] == want.client["tokens_seen"]
    assert got.model.keys() == want.model.keys()
    for key, tensor in want.model.items():
        torch.testing.assert_close(got.model[key], tensor, atol=atol, rtol=0, msg=key)
    assert got.optimizer["state"].keys() == want.optimizer["state"].keys()
    for key, moments in want.optimizer["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                got.optimizer["state"][key][moment], moments[moment], atol=atol, rtol=0, msg=key
            )
    data, ref_data = got.client["TextDataModule"], want.client["TextDataModule"]
    assert (data["trained_hash"], data["trained_samples"]) == (ref_data["trained_hash"], step * batch)


def losses(run_dir) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row["train/loss"]}


def exported(ckpt, out_dir) -> dict:
    export_hf([f"ckpt_path={ckpt}", f"out_dir={out_dir}"])
    return load_file(out_dir / "model.safetensors")


def sample(run_dir) -> str:
    """The report's sample, whole, as the run wrote it (the console may interleave other ranks' lines with it)."""
    return (run_dir / SAMPLE).read_text()


@pytest.mark.parametrize("name", PARITY)
def test_each_layout_trains_like_one_process(runs, name, tmp_path):
    tmp = runs["dir"]
    want = exported(tmp / "ref" / "checkpoints" / f"step{STEPS:07d}.ckpt", tmp_path / "ref")
    got = exported(tmp / name / "checkpoints" / "last.ckpt", tmp_path / name)
    assert got.keys() == want.keys()
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    assert diff <= TOLERANCE, f"{name}: max weight diff {diff:.2e}"
    ref_loss, run_loss = losses(tmp / "ref"), losses(tmp / name)
    assert sorted(run_loss) == list(range(1, STEPS + 1))
    for step, loss in run_loss.items():
        assert loss == pytest.approx(ref_loss[step], abs=TOLERANCE), f"{name} step {step}"
    info = universal.writer_info(tmp / name / "checkpoints" / "last.ckpt")
    sizes, batch, _ = PARITY[name]
    assert (info["strategy"], info["format"], info["world_size"]) == (
        "model_parallel",
        "dcp",
        math.prod(sizes.values()),
    )
    assert info["dims"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, **sizes}


def test_every_layout_samples_the_same_text_at_the_end(runs):
    texts = {name: sample(runs["dir"] / name) for name in PARITY}
    assert len(set(texts.values())) == 1 and texts["tp"].strip(), texts


def test_parallama_generate_reads_a_tensor_parallel_checkpoint(runs):
    args = ["prompt=The", "max_new_tokens=12", "temperature=0"]
    tmp = runs["dir"]
    text = generate_text([f"ckpt_path={tmp / 'fsdp_tp' / 'checkpoints' / 'last.ckpt'}", *args])
    ref = tmp / "ref" / "checkpoints" / f"step{STEPS:07d}.ckpt"
    assert len(text) > len("The") and text == generate_text([f"ckpt_path={ref}", *args])


@pytest.mark.parametrize("name", RESUMES)
def test_a_run_resumes_into_another_layout_exactly(runs, name):
    tmp, step = runs["dir"], 2 * STEPS
    source, _, _, path = RESUMES[name]
    log = runs["log"][name]
    assert ("resuming a " in log) == (path == "universal"), log[-3000:]
    got = universal.read(tmp / name / "checkpoints" / "last.ckpt")
    want = universal.read(tmp / "ref" / "checkpoints" / f"step{step:07d}.ckpt")
    assert_same_state(got, want, step)
