"""parallama-plan and mixtures of experts: the experts' saved activations against a measurement, the ep layouts
the search tries and what they change, the recommendation for Qwen3-30B-A3B on 8 GPUs, and the one-line
refusals of layouts that do not divide."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf
from test_plan import saved_bytes

from parallama import CONF_DIR
from parallama.cli.plan import compose, main, plan
from parallama.distributed.blocks import apply_ac
from parallama.distributed.dims import ParallelDims
from parallama.models.qwen3_moe import Qwen3MoeConfig
from parallama.models.qwen3_moe.model import Qwen3Moe
from parallama.parallel.layout_checks import check_layout
from parallama.parallel.layouts import (
    Layout,
    estimate_layout,
    expert_padding,
    expert_parallel,
    search,
    stage_params,
)
from parallama.parallel.memory import moe_activation_bytes
from parallama.parallel.plan import estimate, prefer_expert_parallel, profiles

DDP = {"ddp": profiles()["ddp"]}
SMALL = Qwen3MoeConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,  # the dense block's: not top_k x moe_intermediate_size (4 x 32)
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    num_experts=8,
    num_experts_per_tok=4,
    mlp_only_layers=[3],
)
fields = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / "qwen3_moe_30b_a3b.yaml"))
fields.pop("family")
A3B = Qwen3MoeConfig(**fields)
SHAPE = dict(seq_len=4096, micro_batch=1, precision="bf16-mixed")


def _activations(c, checkpointing=False) -> int:
    shape = dict(world_size=1, seq_len=128, micro_batch=2, precision="32-true")
    return estimate(c, **shape, activation_checkpointing=checkpointing, strategies=DDP)["ddp"].activations


def test_saved_activation_bytes_of_a_mixture_of_experts_match_the_estimate_in_fp32():
    """Three sparse blocks and a dense one; without the experts' term the estimate is 1.7x short."""
    torch.manual_seed(0)
    ids = torch.randint(0, SMALL.vocab_size, (2, 128))
    measured, expected = saved_bytes(Qwen3Moe(SMALL), ids), _activations(SMALL)
    # CPU runs RMSNorm unfused, which also saves the normalized input (as the Llama's test_plan says)
    assert 1.0 <= measured / expected < 1.2, measured / expected
    dense_only = expected - moe_activation_bytes(SMALL, 256, 4, False)
    assert measured / dense_only > 1.6
    model = Qwen3Moe(SMALL)
    apply_ac(model)
    assert saved_bytes(model, ids) < _activations(SMALL, True) < expected / 2


def test_a_mixture_of_experts_with_a_dense_block_is_planned_whole_and_in_stages():
    """qwen3_moe_tiny's dense last block: a stage of 2 blocks, or the 1 and 2 blocks the FSDP working set is
    counted from, hold no dense block past their end (the planner crashed on them)."""
    result = plan(compose(["model=qwen3_moe_tiny", "trainer.devices=2"]), 80, [])
    assert result["active_params"] < result["num_params"] and result["recommendation"]["strategy"] == "ddp"
    tiny = replace(SMALL, mlp_only_layers=[3])
    two = estimate_layout(tiny, Layout(ParallelDims(pp=2)), **SHAPE, activation_checkpointing=False)
    assert two.activations > 0


def test_the_search_tries_ep_largest_first_within_a_node_where_it_divides():
    assert expert_parallel(A3B, ParallelDims(dp_shard=8), 8) == [8, 4, 2, 1]
    assert expert_parallel(A3B, ParallelDims(dp_shard=4, tp=2), 8) == [4, 2, 1]  # ep x tp ranks in a node
    assert expert_parallel(A3B, ParallelDims(dp_shard=16), 8) == [8, 4, 2, 1]  # not across nodes
    assert expert_parallel(
        replace(A3B, num_experts=6, num_experts_per_tok=2), ParallelDims(dp_shard=8), 8
    ) == [2, 1]
    assert expert_parallel(A3B, ParallelDims(dp_shard=4, cp=2), 8) == [1]  # ep with cp: not supported
    from parallama.models.llama.config import LlamaConfig

    assert expert_parallel(LlamaConfig(), ParallelDims(dp_shard=8), 8) == [1]


def test_ep_gathers_fewer_experts_adds_its_buffers_and_leaves_the_states():
    """The states are the experts' share either way (E/ep experts FSDP-sharded over dp_shard/ep, the dense part
    over dp_shard); ep gathers E/ep of a block's experts, and holds a block's send and receive buffers."""
    fsdp, ep = (
        estimate_layout(A3B, Layout(ParallelDims(dp_shard=8, ep=n)), **SHAPE, activation_checkpointing=False)
        for n in (1, 8)
    )
    assert (fsdp.params, fsdp.grads, fsdp.optim) == (ep.params, ep.grads, ep.optim)
    assert ep.gathered < fsdp.gathered / 2
    k, h = A3B.num_experts_per_tok, A3B.hidden_size
    assert ep.activations - fsdp.activations == 4096 * 2 * k * h * 2  # bf16 send and receive
    # the experts' saved activations: top_k x (3h + 4 moe_intermediate_size) per token, not the dense 4 x 6144
    assert fsdp.activations > 48 * 4096 * (3 * k * h + 4 * k * 768) * 2


def test_qwen3_moe_30b_a3b_on_8_h100s_is_planned_with_ep_8():
    args = ["model=qwen3_moe_30b_a3b", "trainer.devices=8", "data.seq_len=4096", "data.batch_size=1"]
    result = plan(compose(args), 80, args)
    assert result["flops_per_token"] == A3B.flops_per_token(4096)  # MFU's: the active parameters'
    assert result["flops_per_token"] < 6 * result["num_params"] / 5
    rec = result["recommendation"]
    assert (
        rec["strategy"] == "model_parallel"
        and rec["layout"]["ep"] == 8
        and "expert parallelism" in rec["why"]
    )
    assert result["estimates_checkpointing"]["fsdp"]["fits"]  # FSDP alone would fit too: ep is preferred
    assert "strategy.ep=8" in rec["command"] and "activation_checkpointing=true" in rec["command"]
    planned = [o for o in rec["command"].split()[1:]]
    check_layout(compose(planned), on_gpu=True)  # what parallama-train would check


def test_a_moe_pipeline_is_planned_with_a_schedule_train_runs():
    """The load-balancing loss needs the step's counts before backward (gpipe); loss-free balancing any schedule."""
    biased = replace(A3B, router_aux_loss_coef=0.0, router_bias_update_rate=1e-3)
    # 8 sequences on 100 GB GPUs: pp=2 x ep=4 with checkpointing is the first that fits
    shape = {**SHAPE, "micro_batch": 8}
    for config, schedule in ((A3B, "gpipe"), (biased, "1f1b")):
        layout, ckpt, _ = search(config, nodes=1, gpus_per_node=8, **shape, gpu_memory_gb=100)
        assert (layout.dims.pp, layout.dims.ep, ckpt, layout.pp_schedule) == (2, 4, True, schedule)
    args = ["model=qwen3_moe_30b_a3b", "trainer.devices=8", "data.seq_len=4096", "data.batch_size=8"]
    rec = plan(compose(args), 100, args)["recommendation"]
    assert "strategy.pp=2" in rec["command"] and "strategy.pp_schedule=gpipe" in rec["command"]
    check_layout(compose(rec["command"].split()[1:]), on_gpu=True)  # what parallama-train would check


def test_prefer_expert_parallel_only_replaces_fully_sharded():
    strategies = profiles()
    fsdp, ddp = ("fsdp", True, "why"), ("ddp", False, "why")
    assert prefer_expert_parallel(fsdp, strategies, {"model_parallel": True}, {"model_parallel": 4})[0] == (
        "model_parallel"
    )
    assert prefer_expert_parallel(fsdp, strategies, {"model_parallel": False}, {"model_parallel": 4}) == fsdp
    assert prefer_expert_parallel(fsdp, strategies, {"model_parallel": True}, {"model_parallel": 1}) == fsdp
    assert prefer_expert_parallel(ddp, strategies, {"model_parallel": False}, {"model_parallel": 4}) == ddp


@pytest.mark.parametrize(
    "layout, message",
    [
        (["trainer.devices=8", "strategy.ep=3"], "strategy.ep=3 must divide strategy.dp_shard=8"),
        (["trainer.devices=16", "strategy.ep=16"], "strategy.ep=16 must divide model.num_experts=8"),
        (["trainer.devices=8", "strategy.tp=2", "strategy.ep=8"], "must divide strategy.dp_shard=4"),
    ],
)
def test_layouts_that_do_not_divide_are_one_line(capsys, layout, message):
    with pytest.raises(SystemExit) as exit_:
        main(["model=qwen3_moe_tiny", "strategy=model_parallel", *layout])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err


def test_more_ranks_than_experts_hold_a_padded_expert_each():
    """FSDP2 shards a block's stacked experts on the expert dimension: 128 experts over 256 ranks leave each
    rank a whole (padded) expert per block, half an expert more than 128 / 256 (also with ep=8: 16 over 32)."""
    per_expert = 3 * A3B.hidden_size * A3B.moe_intermediate_size
    for ep in (1, 8):
        assert expert_padding(A3B, ParallelDims(dp_shard=128, ep=ep)) == 0
        dims = ParallelDims(dp_shard=256, ep=ep)
        assert expert_padding(A3B, dims) == 48 * per_expert // 2
        e = estimate_layout(A3B, Layout(dims), **SHAPE, activation_checkpointing=False)
        assert e.params == -(-stage_params(A3B, dims) * 4 // 256) + 48 * per_expert // 2 * 4
    assert expert_padding(A3B, ParallelDims(dp_shard=256, pp=2)) == 24 * per_expert // 2  # a stage's blocks
