"""parallama-plan's N-D layouts (parallel/layouts.py): what each dimension divides, the search's choices for the
Llama 3 presets and for long sequences, and that the presets plan to their own layout (their composing on the
command line: tests/integration/test_plan_nd_cli.py)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from parallama import CONF_DIR
from parallama.cli.plan import compose, main, plan
from parallama.distributed.dims import ParallelDims
from parallama.models.llama.config import LlamaConfig
from parallama.parallel.layouts import Layout, candidates, estimate_layout, in_flight, search, stage_params
from parallama.parallel.plan import estimate


def model(name: str, **changes) -> LlamaConfig:
    fields = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    fields.pop("family")
    return LlamaConfig(**{**fields, **changes})


LLAMA3_8B, LLAMA3_70B = model("llama3_8b"), model("llama3_70b")
SHAPE = dict(seq_len=8192, micro_batch=8, precision="bf16-mixed")


def layout(sp=False, schedule="1f1b", microbatches=None, **sizes) -> Layout:
    return Layout(
        ParallelDims(**sizes), sequence_parallel=sp, pp_schedule=schedule, pp_microbatches=microbatches
    )


def mem(c, lay: Layout, ckpt=False, **shape):
    return estimate_layout(c, lay, activation_checkpointing=ckpt, **{**SHAPE, **shape})


def test_llama3_70b_preset_is_llama3_70b():
    assert LLAMA3_70B.num_params() == 70_553_706_496  # Meta-Llama-3-70B's parameter count


def test_one_rank_layout_is_the_whole_model_and_fsdp_over_all_ranks_equals_strategy_fsdp():
    c = LLAMA3_8B
    assert stage_params(c, ParallelDims()) == c.num_params()
    fsdp = estimate(c, world_size=8, activation_checkpointing=True, **SHAPE)["fsdp"]
    assert mem(c, layout(dp_shard=8), ckpt=True) == fsdp


def test_tp_divides_the_block_matmuls_and_the_vocabulary_but_not_the_norms():
    c, h = LLAMA3_8B, LLAMA3_8B.hidden_size
    one, two = stage_params(c, ParallelDims()), stage_params(c, ParallelDims(tp=2))
    norms = c.num_hidden_layers * 2 * h + h
    assert two == (one - norms) // 2 + norms
    e1, e2 = mem(c, layout(dp_shard=1)), mem(c, layout(dp_shard=1, tp=2))
    assert (e2.params, e2.grads, e2.optim) == (4 * two, 4 * two, 8 * two)
    assert e2.activations < e1.activations  # attention/MLP internals and the logits halve ...
    assert e2.activations > e1.activations / 2  # ... the projections' (gathered) inputs do not


def test_sequence_parallel_divides_the_residual_stream_and_fsdp_divides_what_tp_leaves():
    c = LLAMA3_8B
    plain, sp = mem(c, layout(dp_shard=1, tp=2)), mem(c, layout(True, dp_shard=1, tp=2))
    h, tokens, layers = c.hidden_size, 8 * 8192, c.num_hidden_layers
    # per layer two norm inputs, plus the final norm's input; bf16, halved by sequence parallel
    assert plain.activations - sp.activations == tokens * (2 * layers + 1) * h * 2 // 2
    fsdp4 = mem(c, layout(True, dp_shard=4, tp=2))
    assert fsdp4.params == math.ceil(stage_params(c, ParallelDims(tp=2)) * 4 / 4)
    assert fsdp4.optim == math.ceil(stage_params(c, ParallelDims(tp=2)) * 8 / 4)


def test_pp_holds_half_the_layers_and_its_micro_batches_in_flight():
    c = LLAMA3_70B
    one, two = stage_params(c, ParallelDims()), stage_params(c, ParallelDims(pp=2))
    table, block = (
        c.vocab_size * c.hidden_size,
        (one - 2 * c.vocab_size * c.hidden_size - c.hidden_size) // 80,
    )
    assert (
        two == 40 * block + table + c.hidden_size
    )  # the last stage: half the blocks, the head, the final norm
    ckpt = dict(ckpt=False, micro_batch=8)
    base = mem(c, layout(dp_shard=1, tp=8), **ckpt).activations
    # 1F1B, one micro-batch per stage: the first stage holds both halves of the batch for half the layers
    f1b = mem(c, layout(dp_shard=1, tp=4, pp=2), **ckpt)
    assert in_flight(layout(dp_shard=1, pp=2)) == 2
    assert in_flight(layout(dp_shard=1, pp=2, microbatches=8)) == 2  # 1F1B: at most pp in flight
    assert in_flight(layout(schedule="gpipe", dp_shard=1, pp=2, microbatches=8)) == 8  # GPipe: all of them
    assert in_flight(layout(schedule="interleaved_1f1b", dp_shard=1, pp=2)) == 3
    no_pp = mem(c, layout(dp_shard=2, tp=4), **ckpt)
    assert f1b.activations < no_pp.activations and base < no_pp.activations


def test_zero_bubble_schedules_keep_the_stage_gathered_and_1f1b_s_micro_batches_in_flight():
    c = LLAMA3_70B
    sizes = dict(dp_shard=4, tp=8, pp=2)
    f1b, zbv = mem(c, layout(**sizes)), mem(c, layout(schedule="zbv", **sizes))
    head_and_norm = c.vocab_size * c.hidden_size // 8 + c.hidden_size  # the last stage's
    matmuls_and_norms = (stage_params(c, ParallelDims(tp=8, pp=2)) - head_and_norm) // 40
    assert zbv.gathered - f1b.gathered == 38 * matmuls_and_norms * 2  # 40 blocks gathered in bf16, not 2
    assert (zbv.params, zbv.grads, zbv.optim, zbv.activations) == (
        f1b.params,
        f1b.grads,
        f1b.optim,
        f1b.activations,
    )
    assert in_flight(layout(schedule="zbv", dp_shard=1, pp=4, microbatches=8)) == 4
    assert in_flight(layout(schedule="dualpipev", dp_shard=1, pp=4, microbatches=8)) == 5
    assert in_flight(layout(schedule="interleaved_zb", dp_shard=1, pp=2)) == 3


def test_cp_halves_activations_and_shards_states_with_dp_shard():
    c = LLAMA3_8B
    one, two = mem(c, layout(dp_shard=1, tp=2)), mem(c, layout(dp_shard=1, tp=2, cp=2))
    assert two.activations == one.activations // 2
    assert two.params == one.params // 2  # FSDP runs over dp_shard x cp


def test_candidates_keep_tp_within_a_node_and_try_hsdp_before_fsdp_across_nodes():
    found = candidates(LLAMA3_70B, nodes=4, gpus_per_node=8, seq_len=8192, micro_batch=8)
    assert all(x.dims.tp <= 8 and x.dims.world_size == 32 for x in found)
    tp8 = [x.dims for x in found if x.dims.tp == 8 and x.dims.pp == x.dims.cp == 1]
    assert tp8 == [ParallelDims(dp_replicate=4, dp_shard=1, tp=8), ParallelDims(dp_shard=4, tp=8)]
    assert found[0].dims == ParallelDims(dp_replicate=4, dp_shard=8)  # HSDP first: replicas across nodes
    assert found[-1].dims.pp > 1  # the pipeline last
    short = candidates(LLAMA3_70B, nodes=4, gpus_per_node=8, seq_len=4096, micro_batch=8)
    assert all(x.dims.cp == 1 for x in short)  # 2048 tokens per cp rank: too short for the ring


@pytest.mark.parametrize(
    "name, nodes, seq_len, micro_batch, expected",
    [
        ("llama3_8b", 1, 8192, 6, ParallelDims(dp_shard=4, tp=2)),  # the llama3_8b_tp preset
        ("llama3_70b", 4, 8192, 8, ParallelDims(dp_shard=4, tp=8)),  # the llama3_70b_nd preset
        ("llama3_8b", 1, 262144, 1, ParallelDims(dp_shard=1, cp=4, tp=2)),  # long context: the sequence split
        ("llama3_70b", 4, 4096, 32, ParallelDims(dp_shard=2, tp=8, pp=2)),  # short sequences, big batch: PP
    ],
)
def test_recommended_layouts(name, nodes, seq_len, micro_batch, expected):
    c = model(name, max_position_embeddings=max(seq_len, 8192))
    found, ckpt, plans = search(
        c,
        nodes=nodes,
        gpus_per_node=8,
        seq_len=seq_len,
        micro_batch=micro_batch,
        precision="bf16-mixed",
        gpu_memory_gb=80,
    )
    assert found.dims == expected and found.sequence_parallel and ckpt
    assert plans[True].fits(80) and not plans[False].fits(80)


def test_70b_on_two_nodes_fits_one_sequence_per_replica_not_eight():
    """The fp32 states sharded over all 16 GPUs are already 65.7 GiB, whatever the layout (a pipeline shards no
    more of them): one 8192-token sequence per replica still fits (tp=8), eight fit no layout."""
    shape = dict(nodes=2, gpus_per_node=8, seq_len=8192, precision="bf16-mixed", gpu_memory_gb=80)
    found, ckpt, plans = search(LLAMA3_70B, micro_batch=1, **shape)
    assert found.dims == ParallelDims(dp_shard=2, tp=8) and ckpt
    assert (plans[True].params + plans[True].grads + plans[True].optim) / 2**30 == pytest.approx(
        65.7, abs=0.05
    )
    assert search(LLAMA3_70B, micro_batch=8, **shape)[0] is None


@pytest.mark.parametrize(
    "preset, sizes",
    [("plan/llama3_8b_tp", {"dp_shard": 4, "tp": 2}), ("plan/llama3_70b_nd", {"dp_shard": 4, "tp": 8})],
)
def test_each_preset_plans_to_its_own_layout(preset, sizes):
    result = plan(compose([f"experiment={preset}"]), 80, [f"experiment={preset}"])
    rec = result["recommendation"]
    assert rec["strategy"] == "model_parallel" and rec["activation_checkpointing"]
    assert rec["layout"] == {"dp_replicate": 1, "cp": 1, "pp": 1, **sizes, "sequence_parallel": True}
    configured = result["estimates_checkpointing"]["model_parallel (as configured)"]
    assert configured["fits"] and configured == result["estimates_checkpointing"]["model_parallel"]
    assert not result["estimates_checkpointing"]["fsdp"]["fits"]
    assert rec["command"].startswith(f"parallama-train experiment={preset} strategy=model_parallel ")


def test_the_cli_lists_model_parallel_with_its_layout(capsys):
    main(["experiment=plan/llama3_70b_nd", "json=true"])
    out = json.loads(capsys.readouterr().out)
    assert out["estimates"]["model_parallel"]["layout"] == "dp_shard=4 x tp=8 + SP"
    assert out["world_size"] == 32 and out["recommendation"]["strategy"] == "model_parallel"


def test_a_stage_of_a_tied_model_and_layout_overrides():
    tied = replace(LLAMA3_8B, tie_word_embeddings=True)
    assert stage_params(tied, ParallelDims()) == tied.num_params()
    lay = layout(True, dp_replicate=2, dp_shard=2, tp=2, pp=2)
    assert lay.overrides() == [
        "strategy=model_parallel",
        "strategy.dp_replicate=2",
        "strategy.dp_shard=2",
        "strategy.tp=2",
        "strategy.pp=2",
        "strategy.sequence_parallel=true",
        "strategy.pp_schedule=1f1b",
    ]
