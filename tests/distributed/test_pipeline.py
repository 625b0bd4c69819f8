"""Pipeline parallelism (strategy=model_parallel strategy.pp=2) on CPU (gloo): each schedule trains like one
process, and a run resumes across layouts.

Parity: one process at micro-batch 8 (the reference, a 4-layer model so that 2 ranks hold 2 stages each)
against, for 3 optimizer steps with gradient clipping on (the norm over both stages),

    gpipe (2 ranks x 8, 2 microbatches)            interleaved_1f1b (2 x 8, 2 stages per rank, 4 microbatches)
    1f1b on pp=2 x dp_shard=2 (4 ranks x 4: FSDP2 inside each stage)
    1f1b on pp=2 x tp=2 + sequence parallel (4 ranks x 8: TP inside each stage, the activations sent between
        stages are each tp rank's part of the sequence, the loss on the last stage's vocab-sharded logits)
    the zero-bubble schedules (weight gradients deferred): interleaved_zb (2 x 8, 2 stages per rank, 4
        microbatches), zbv on pp=2 x dp_shard=2 (4 x 4; V-shaped: rank 0 holds the first and the last stage),
        dualpipev (2 x 8, 4 microbatches; its forward and backward overlap)

the same global batch 8: weights and AdamW moments after 3 steps (to 1e-5), val/loss at every validation and
train/loss at every step (metrics.csv, written by rank 0, which holds the first stage: its loss is the last
stage's, broadcast, and on 4 ranks the mean of both data-parallel halves). Every run validates (the schedule's
eval()) and samples at the end (the model gathered from the stages).

Resume: from step 3 to step 6, each equal to the reference's step 6 (weights and moments to 1e-5, counters,
the data position's running hash):

    zbv x dp_shard=2 (DCP, each stage's keys) -> strategy=fsdp on 1 process  the universal path out of PP
    pp=2 x tp=2 + SP (DCP, stages of TP DTensors) -> dp_shard=4 on 4 ranks    DCP reshards out of PP and TP
    the reference (one process, a Lightning file) -> pp=2 looped_bfs          a stage loads its share of it
        (built on the meta device: meta_init=true)

The LR is constant (a run's schedule then does not depend on its length) and low enough that reduction-order
noise stays far below 1e-5 after Adam.
"""

from __future__ import annotations

import csv

import pytest
from safetensors.torch import load_file
from test_model_parallel import COMMON as PARITY_COMMON
from test_model_parallel import MP, STEPS, TOLERANCE, assert_same_state, sample, train_matrix

from parallama.checkpoint import universal
from parallama.cli.export import main as export_hf
from parallama.cli.generate import generate_text
from parallama.distributed.options import ZERO_BUBBLE

pytestmark = pytest.mark.multiprocess

COMMON = [
    *PARITY_COMMON,
    "model.num_hidden_layers=4",  # 2 stages per rank on 2 ranks
    "trainer.val_check_interval=3",  # the reference and the 3-step runs validate after step 3 alike
]
SCHEDULES = {  # name: (mesh sizes, per-rank batch, more overrides); each trains on global batch 8
    "gpipe": ({"pp": 2}, 8, ["strategy.pp_schedule=gpipe"]),
    "interleaved_1f1b": (
        {"pp": 2},
        8,
        [
            "strategy.pp_schedule=interleaved_1f1b",
            "strategy.pp_stages_per_rank=2",
            "strategy.pp_microbatches=4",
        ],
    ),
    "1f1b_fsdp": ({"pp": 2, "dp_shard": 2}, 4, ["strategy.pp_schedule=1f1b"]),
    "1f1b_tp_sp": ({"pp": 2, "tp": 2}, 8, ["strategy.pp_schedule=1f1b", "strategy.sequence_parallel=true"]),
    # zero-bubble: the weight gradients after the input gradients, FSDP's parameters kept gathered for them
    "interleaved_zb": (
        {"pp": 2},
        8,
        [
            "strategy.pp_schedule=interleaved_zb",
            "strategy.pp_stages_per_rank=2",
            "strategy.pp_microbatches=4",
        ],
    ),
    # V-shaped: rank 0 holds the first and the last stage (the loss comes from it), eval runs forward actions only
    "zbv_fsdp": ({"pp": 2, "dp_shard": 2}, 4, ["strategy.pp_schedule=zbv", "strategy.pp_stages_per_rank=2"]),
    "dualpipev": ({"pp": 2}, 8, ["strategy.pp_schedule=dualpipev"]),  # pp_stages_per_rank=null: the V's 2
}
RESUMES = {  # name: (source run, ranks, overrides, how it loads)
    "pp_to_fsdp1": ("zbv_fsdp", 1, ["strategy=fsdp", "data.batch_size=8"], "universal"),
    "pp_tp_to_dp_shard4": ("1f1b_tp_sp", 4, [MP, "strategy.dp_shard=4", "data.batch_size=2"], "native"),
    "file_to_pp": (
        "ref",
        2,
        [
            MP,
            "strategy.pp=2",
            "strategy.pp_schedule=looped_bfs",
            "strategy.pp_stages_per_rank=2",
            "strategy.meta_init=true",  # the stages built on the meta device: the checkpoint fills them
            "data.batch_size=8",
        ],
        "universal",
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """The reference (6 steps, a checkpoint every 3), a run per schedule (3 steps) and the resumes (to step 6)."""
    tmp = tmp_path_factory.mktemp("pipeline")
    return {"dir": tmp, "log": train_matrix(tmp, data_cache, COMMON, SCHEDULES, RESUMES)}


def metric(run_dir, key: str) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row[key]}


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_schedule_trains_like_one_process(runs, name):
    tmp, log = runs["dir"], runs["log"][name]
    assert "Traceback" not in log and sample(tmp / name).strip()
    schedule = next(a.split("=")[1] for a in SCHEDULES[name][2] if a.startswith("strategy.pp_schedule="))
    assert ("reshard_after_forward is taken as false" in log) == (schedule in ZERO_BUBBLE)
    got = universal.read(tmp / name / "checkpoints" / "last.ckpt")  # every stage's keys, under their names
    want = universal.read(tmp / "ref" / "checkpoints" / f"step{STEPS:07d}.ckpt")
    assert_same_state(got, want, STEPS)
    ref_val, run_val = metric(tmp / "ref", "val/loss"), metric(tmp / name, "val/loss")
    assert len(run_val) == 2 and set(run_val) <= set(ref_val)  # before training and after step 3
    for step, loss in run_val.items():
        assert loss == pytest.approx(ref_val[step], abs=TOLERANCE), f"{name} val/loss at {step}"
    ref_loss, run_loss = metric(tmp / "ref", "train/loss"), metric(tmp / name, "train/loss")
    assert sorted(run_loss) == list(range(1, STEPS + 1))
    for step, loss in run_loss.items():
        assert loss == pytest.approx(ref_loss[step], abs=TOLERANCE), f"{name} train/loss at {step}"
    info = universal.writer_info(tmp / name / "checkpoints" / "last.ckpt")
    sizes = SCHEDULES[name][0]
    assert (info["strategy"], info["format"]) == ("model_parallel", "dcp")
    assert info["dims"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, **sizes}


def test_every_schedule_samples_the_same_text_at_the_end(runs):
    texts = {name: sample(runs["dir"] / name) for name in SCHEDULES}
    assert len(set(texts.values())) == 1, texts


def test_export_and_generate_read_a_pipeline_checkpoint_as_the_whole_model(runs, tmp_path):
    tmp = runs["dir"]
    pp, ref = (
        tmp / "interleaved_1f1b" / "checkpoints" / "last.ckpt",
        tmp / "ref" / "checkpoints" / "step0000003.ckpt",
    )
    export_hf([f"ckpt_path={pp}", f"out_dir={tmp_path / 'pp'}"])
    export_hf([f"ckpt_path={ref}", f"out_dir={tmp_path / 'ref'}"])
    got, want = (
        load_file(tmp_path / "pp" / "model.safetensors"),
        load_file(tmp_path / "ref" / "model.safetensors"),
    )
    assert got.keys() == want.keys() and "model.layers.3.mlp.down_proj.weight" in got
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= TOLERANCE

    from transformers import LlamaForCausalLM

    assert LlamaForCausalLM.from_pretrained(tmp_path / "pp").config.num_hidden_layers == 4
    args = ["prompt=The", "max_new_tokens=12", "temperature=0"]
    text = generate_text([f"ckpt_path={pp}", *args])
    assert len(text) > len("The") and text == generate_text([f"ckpt_path={ref}", *args])


@pytest.mark.parametrize("name", RESUMES)
def test_a_run_resumes_into_and_out_of_pipeline_stages_exactly(runs, name):
    tmp, step = runs["dir"], 2 * STEPS
    source, _, _, path = RESUMES[name]
    log = runs["log"][name]
    if path == "universal":
        assert f"resuming a {'auto' if source == 'ref' else 'model_parallel'} checkpoint" in log
    else:  # the same strategy: DCP reshards the stages' TP shards into FSDP's itself
        assert "resuming a " not in log and "Traceback" not in log
    got = universal.read(tmp / name / "checkpoints" / "last.ckpt")
    want = universal.read(tmp / "ref" / "checkpoints" / f"step{step:07d}.ckpt")
    assert_same_state(got, want, step)
