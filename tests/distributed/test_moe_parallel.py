"""Expert parallelism (`strategy.ep`, models/moe_parallel.py) on `model=qwen3_moe_tiny` with its router losses on (load
balancing 0.01, z-loss 0.001; a sparse and a dense block): ep=2 (2 ranks, also with full activation checkpointing:
the all-to-alls run again in backward, and per-op selective: the experts recomputed whole, also compiled), ep=2 x
dp_shard=2 and ep=2 x tp=2 with and without sequence parallel, pp=2 x ep=2 (gpipe, two microbatches: the stages add
their router losses in backward, balanced by the step's counts of both; also per-op selective) (4 ranks), pp=2 with
full checkpointing (a stage's recomputation records no more counts) and without experts sharded cp=2 and ddp at 2
ranks, each end with the weights of one process after 3 steps (1e-5) and log the same loss, load-balancing loss and
expert imbalance at every step: the balancing counts are the global batch's in every layout (with each rank's own
counts instead, ddp at 2 ranks ends 8e-4 away from one process on the routers, measured). A step-3 checkpoint of
ep=2 x dp_shard=2 resumed as one process, and one process's resumed as ep=2, equal the uninterrupted run at step 6.
With DeepSeek-V3's loss-free balancing instead, ep=2 and pp=2 (1F1B) move the routers' biases as one process does."""

from __future__ import annotations

import csv

import pytest
import torch
from conftest import train
from test_model_parallel import COMMON, QUIET, assert_same_state, exported

from parallama.checkpoint import universal

pytestmark = pytest.mark.multiprocess

STEPS, TOLERANCE = 3, 1e-5
MOE = ["model=qwen3_moe_tiny", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
       "model.mlp_only_layers=[1]"]  # fmt: skip
MP = "strategy=model_parallel"
PARITY = {  # name: (ranks, overrides); every layout trains on the global batch 8
    "ep2": (2, [MP, "strategy.ep=2", "data.batch_size=4"]),
    "ep2_full_ac": (
        2,
        [MP, "strategy.ep=2", "activation_checkpointing=full", "data.batch_size=4"],
    ),  # a2a again
    "ep2_dp_shard2": (4, [MP, "strategy.ep=2", "data.batch_size=2"]),
    # per-op selective checkpointing: the experts (their own FSDP hooks) recomputed whole, the rest per op
    # (without that, torch's per-op recomputation failed: 'invocation index 2 ... not found')
    "ep2_sac": (2, [MP, "strategy.ep=2", "activation_checkpointing=selective", "data.batch_size=4"]),
    # compiled blocks under per-op selective checkpointing: the experts' weights are this rank's shard (compile
    # read hasattr(w, "to_local") as False and failed on a DTensor in the matmul), their call traced outside the
    # checkpoint's dispatch modes
    "ep2_compile_sac": (
        2,
        [MP, "strategy.ep=2", "compile=true", "activation_checkpointing=selective", "data.batch_size=4"],
    ),
    "ep2_tp2": (4, [MP, "strategy.ep=2", "strategy.tp=2", "data.batch_size=4"]),
    "ep2_tp2_sp": (
        4,
        [MP, "strategy.ep=2", "strategy.tp=2", "strategy.sequence_parallel=true", "data.batch_size=4"],
    ),
    # gpipe (every forward before the backwards), two microbatches: the balancing counts are both's
    "pp2_ep2": (4, [MP, "strategy.pp=2", "strategy.ep=2", "strategy.pp_schedule=gpipe", "data.batch_size=4"]),
    # full checkpointing in the stages: a recomputed forward (inside backward) records no more counts
    "pp2_full_ac": (
        2,
        [
            MP,
            "strategy.pp=2",
            "strategy.pp_schedule=gpipe",
            "activation_checkpointing=full",
            "data.batch_size=8",
        ],
    ),
    "pp2_ep2_sac": (
        4,
        [
            MP,
            "strategy.pp=2",
            "strategy.ep=2",
            "strategy.pp_schedule=gpipe",
            "activation_checkpointing=selective",
            "data.batch_size=4",
        ],
    ),  # fmt: skip
    "cp2": (2, [MP, "strategy.cp=2", "data.batch_size=8"]),  # the balancing counts add up over cp ranks too
    "ddp": (2, ["strategy=ddp", "data.batch_size=4"]),
}
# DeepSeek-V3's loss-free balancing, the sparse block last: on pp=2's last stage, where 1F1B runs each
# microbatch's backward before the next forward
BIAS = ["model.router_bias_update_rate=0.01", "model.router_aux_loss_coef=0", "model.mlp_only_layers=[0]"]
RESUMES = {  # name: (source run, ranks, overrides)
    "ep2_dp_shard2_to_1": ("ep2_dp_shard2", 1, ["data.batch_size=8"]),
    "1_to_ep2": ("ref", 2, [MP, "strategy.ep=2", "data.batch_size=4"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """The reference (6 steps, a checkpoint every 3), the parity runs (3 steps) and the resumes (to step 6)."""
    tmp = tmp_path_factory.mktemp("moe_parallel")

    def run(name, ranks, steps, *args):
        train(*MOE, *COMMON, *QUIET, f"trainer.devices={ranks}", f"trainer.max_steps={steps}", *args, cwd=tmp,
              cache=data_cache, run_dir=tmp / name, timeout=600)  # fmt: skip

    every_3_steps = [
        "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.save_top_k=-1",
        f"+callbacks.model_checkpoint.every_n_train_steps={STEPS}",
    ]
    run("ref", 1, 2 * STEPS, "data.batch_size=8", *every_3_steps)
    for name, (ranks, args) in PARITY.items():
        run(name, ranks, STEPS, *args)
    run("ref_bias", 1, STEPS, "data.batch_size=8", *BIAS)
    run("ep2_bias", 2, STEPS, MP, "strategy.ep=2", "data.batch_size=4", *BIAS)
    run("pp2_bias", 2, STEPS, MP, "strategy.pp=2", "data.batch_size=8", *BIAS)  # 1F1B, two microbatches
    for name, (source, ranks, args) in RESUMES.items():
        ckpt = tmp / source / "checkpoints" / ("last.ckpt" if source != "ref" else f"step{STEPS:07d}.ckpt")
        run(name, ranks, 2 * STEPS, *args, f"ckpt_path={ckpt}")
    return tmp


def metrics(run_dir) -> dict[int, dict[str, float]]:
    names = ("train/loss", "train/aux_loss", "train/router_z_loss", "train/expert_imbalance")
    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row["train/loss"]]
    return {int(row["step"]): {name: float(row[name]) for name in names} for row in rows}


@pytest.mark.parametrize("name", PARITY)
def test_each_layout_trains_like_one_process(runs, name, tmp_path):
    want = exported(runs / "ref" / "checkpoints" / f"step{STEPS:07d}.ckpt", tmp_path / "ref")
    got = exported(runs / name / "checkpoints" / "last.ckpt", tmp_path / name)
    assert got.keys() == want.keys() and any(".mlp.experts.7." in k for k in want)
    diff = {k: (got[k] - want[k]).abs().max().item() for k in want}
    worst = max(diff, key=diff.get)
    print(f"{name}: max weight diff {diff[worst]:.2e} ({worst})")
    assert diff[worst] <= TOLERANCE, f"{name}: max weight diff {diff[worst]:.2e} at {worst}"
    ref, run = metrics(runs / "ref"), metrics(runs / name)
    assert sorted(run) == list(range(1, STEPS + 1))
    for step, values in run.items():
        for key, value in values.items():
            assert value == pytest.approx(ref[step][key], abs=TOLERANCE), f"{name} step {step} {key}"
    if name.startswith("ep"):
        info = universal.writer_info(runs / name / "checkpoints" / "last.ckpt")
        assert info["dims"]["ep"] == 2 and info["format"] == "dcp"


@pytest.mark.parametrize("name", RESUMES)
def test_a_moe_run_resumes_under_another_ep_size_exactly(runs, name):
    step = 2 * STEPS
    got = universal.read(runs / name / "checkpoints" / "last.ckpt")
    want = universal.read(runs / "ref" / "checkpoints" / f"step{step:07d}.ckpt")
    assert_same_state(got, want, step)  # weights, AdamW moments, tokens seen, the data position


@pytest.mark.parametrize("name", ["ep2_bias", "pp2_bias"])
def test_loss_free_balancing_moves_the_same_biases(runs, name):
    """The routers' biases move by the step's global tokens per expert: ep=2, and pp=2 under 1F1B (the step's
    counts are its microbatches', not those of torch's shape inference) end with one process's biases (and
    weights; export refuses the biases, so the checkpoints are compared)."""
    want = universal.read(runs / "ref_bias" / "checkpoints" / "last.ckpt").model
    got = universal.read(runs / name / "checkpoints" / "last.ckpt").model
    biases = [k for k in want if k.endswith("gate.expert_bias")]
    assert biases and all(want[k].abs().min() > 0 for k in biases)  # they moved (3 steps of +-0.01 or 0)
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, atol=TOLERANCE, rtol=0, msg=key)
