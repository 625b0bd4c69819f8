"""parallama-plan's memory terms of the speed levers, one test each: Muon's optimizer state, the fused loss,
selective activation checkpointing (recommended where it fits) and float8's gathered weights; on fixed strategies, on N-D
layouts and through the CLI's config keys."""

import pytest

from parallama.cli.plan import compose, plan
from parallama.distributed.dims import ParallelDims
from parallama.distributed.options import ACOptions
from parallama.models.llama.config import LlamaConfig
from parallama.parallel.layouts import Layout, estimate_layout
from parallama.parallel.memory import (
    FUSED_LOSS_CHUNK,
    GIB,
    HEADROOM,
    activation_bytes,
    float8_gathered,
    loss_bytes,
    loss_fixed_bytes,
    optimizer_state_bytes,
)
from parallama.parallel.plan import estimate
from parallama.training.loss import CrossEntropy

LLAMA_1B = LlamaConfig(  # Llama-3.2-1B's shape (conf/model/llama3_2_1b.yaml)
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
)
SHAPE = dict(
    world_size=8, seq_len=2048, micro_batch=4, precision="bf16-mixed", activation_checkpointing=False
)


def test_muon_keeps_one_buffer_for_the_blocks_matrices():
    c = LLAMA_1B
    matrices = c.num_hidden_layers * c.block_params()[0]
    assert optimizer_state_bytes(c, 8) == 8 * c.num_params()
    assert optimizer_state_bytes(c, 8, "muon") == 8 * c.num_params() - 4 * matrices
    adamw, muon = estimate(c, **SHAPE), estimate(c, **SHAPE, optimizer="muon")
    assert adamw["ddp"].optim - muon["ddp"].optim == 4 * matrices  # replicated
    assert adamw["fsdp"].optim - muon["fsdp"].optim == pytest.approx(4 * matrices / 8, abs=1)  # sharded
    assert (adamw["fsdp"].params, adamw["fsdp"].activations) == (
        muon["fsdp"].params,
        muon["fsdp"].activations,
    )
    layout = Layout(ParallelDims(1, 4, 1, 2, 1), sequence_parallel=True)  # dp_shard 4 x tp 2
    kwargs = dict(seq_len=2048, micro_batch=4, precision="bf16-mixed", activation_checkpointing=False)
    on = estimate_layout(c, layout, optimizer="muon", **kwargs)
    off = estimate_layout(c, layout, **kwargs)
    assert off.optim - on.optim == pytest.approx(4 * matrices / 8, abs=1)  # a rank's half of each matrix, /4


def test_the_fused_loss_keeps_no_logits_but_its_gradients_and_one_chunk():
    """It computes its gradients in the forward: the hidden states' (fp32, per token) and the head weight's (fp32,
    once: 1 GB at Llama-3.2-1B's vocabulary), held until backward; and at the loss it holds one chunk's logits
    (compute dtype) and, eager, their fp32 copy: `loss.chunk_size` tokens, the whole batch when that is fewer."""
    c, tokens = LLAMA_1B, 4 * 2048
    plain = activation_bytes(c, tokens, 2, 4, False)
    fused = activation_bytes(c, tokens, 2, 4, False, loss_impl="fused")
    assert tokens * loss_bytes(c, 2) == tokens * c.vocab_size * (2 + 4 + 4)  # 9.8 GiB here
    head_grad = c.vocab_size * c.hidden_size * 4
    chunk = FUSED_LOSS_CHUNK * c.vocab_size * (2 + 4)  # 2.9 GiB at the default 4096 tokens
    assert loss_fixed_bytes(c, loss_impl="fused") == head_grad and loss_fixed_bytes(c) == 0
    assert loss_fixed_bytes(c, loss_impl="fused", e=2, chunk=FUSED_LOSS_CHUNK) == head_grad + chunk
    assert plain - fused == tokens * (loss_bytes(c, 2) - c.hidden_size * 4) - head_grad - chunk
    few = activation_bytes(c, 100, 2, 4, False, loss_impl="fused") - activation_bytes(
        c, 100, 2, 4, False, head=False
    )
    assert (
        few
        == 100 * (2 * c.hidden_size + 4 * c.hidden_size + 4 * c.hidden_size + c.vocab_size * 6) + head_grad
    )
    assert loss_bytes(c, 2, tp=2) == loss_bytes(c, 2) // 2 and loss_bytes(c, 2, loss_impl="fused") == 4 * 2048
    assert loss_fixed_bytes(c, tp=2, loss_impl="fused") == head_grad // 2  # its vocab-parallel rows
    assert activation_bytes(c, tokens, 2, 4, False, head=False, loss_impl="fused") == activation_bytes(
        c, tokens, 2, 4, False, head=False
    )  # a pipeline stage without the head: no loss
    assert (
        FUSED_LOSS_CHUNK == CrossEntropy().chunk_size == compose([]).loss.chunk_size
    )  # the planner's is the loss's


def test_the_cli_reads_the_optimizer_and_the_loss_impl():
    base = ["model=llama3_2_1b", "trainer.devices=8", "data.seq_len=2048", "data.batch_size=4"]
    default = plan(compose(base), 80, base)
    levers = [*base, "optimizer=muon", "++loss.impl=fused"]  # ++: the key may not be in conf/loss yet
    faster = plan(compose(levers), 80, levers)
    assert any("optimizer=muon" in n for n in faster["notes"]) and any(
        "loss.impl=fused" in n for n in faster["notes"]
    )
    for name in ("ddp", "fsdp"):
        a, b = default["estimates"][name], faster["estimates"][name]
        assert b["optim"] < a["optim"] and b["activations"] < a["activations"] and b["params"] == a["params"]


def test_selective_checkpointing_is_recommended_where_it_fits_and_full_does_not_have_to():
    overrides = ["model=llama3_2_1b", "trainer.devices=1", "data.seq_len=2048", "data.batch_size=8"]
    cfg = compose(overrides)
    sizes = plan(cfg, 1000, overrides)
    none = sizes["estimates"]["ddp"]["total"]
    selective = sizes["estimates_selective"]["ddp"]["total"]
    full = sizes["estimates_checkpointing"]["ddp"]["total"]
    assert full < selective < none
    between = (selective + none) / 2 / HEADROOM / GIB  # a GPU where selective fits and none does not
    rec = plan(cfg, between, overrides)["recommendation"]
    assert rec["strategy"] == "ddp" and rec["activation_checkpointing"] == "selective"
    assert rec["command"].endswith("activation_checkpointing=selective") and "selective" in rec["why"]
    tight = (full + selective) / 2 / HEADROOM / GIB  # only full fits on one GPU
    assert plan(cfg, tight, overrides)["recommendation"]["command"].endswith("activation_checkpointing=true")
    assert compose(rec["command"].split()[1:]).activation_checkpointing == "selective"  # the line composes


def test_a_selective_policy_of_the_run_is_planned_as_given():
    overrides = ["model=llama3_2_1b", "activation_checkpointing=selective"]
    every = [
        *overrides,
        "activation_checkpointing_policy.mode=every_n",
        "activation_checkpointing_policy.every_n=4",
    ]
    op, every_4 = plan(compose(overrides), 80, overrides), plan(compose(every), 80, every)
    assert op["activation_checkpointing"] == "selective"
    assert op["estimates"]["ddp"] == op["estimates_selective"]["ddp"]
    c = LLAMA_1B
    tokens = 16 * 256  # conf/data defaults
    by_policy = [activation_bytes(c, tokens, 2, 4, ACOptions("selective", p, 4)) for p in ("op", "every_n")]
    assert by_policy[0] != by_policy[1]
    delta = op["estimates"]["ddp"]["activations"] - every_4["estimates"]["ddp"]["activations"]
    assert delta == by_policy[0] - by_policy[1]


def test_tensorwise_float8_gathers_the_blocks_weights_in_one_byte():
    c = LLAMA_1B
    matmuls = c.block_params()[0]
    assert float8_gathered(c, "working", 2, "tensorwise") == 2 * matmuls  # two blocks, 2 bytes -> 1
    assert float8_gathered(c, "working", 2, "rowwise") == 0  # gathered in bf16
    bf16, fp8 = estimate(c, **SHAPE), estimate(c, **SHAPE, float8="tensorwise")
    assert bf16["fsdp"].gathered - fp8["fsdp"].gathered == 2 * matmuls
    assert bf16["ddp"] == fp8["ddp"]  # nothing gathered: the same


def test_float8_gathers_in_one_byte_only_the_linears_its_filter_converts():
    """float8_filter=auto keeps Llama-3.2-1B's k/v projections (2048 -> 512) in bf16 (torchao's tensorwise
    filter): they are gathered in 2 bytes, the other block matmuls in 1; `all` gathers every one in 1."""
    from parallama.distributed.float8 import converted_share
    from parallama.models import model_spec

    c = LLAMA_1B
    fields = {
        "family": "llama",
        **{k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size")},
    }
    fields.update(num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8)
    kv = 2 * c.hidden_size * 512
    model, _ = model_spec(fields).shapes(fields)
    assert converted_share(model, "tensorwise", "all") == 1.0
    assert converted_share(model, "tensorwise", "auto") == pytest.approx(1 - kv / c.block_params()[0])
    base = ["model=llama3_2_1b", "trainer.devices=8", "strategy=fsdp", "float8=tensorwise"]
    auto, every = (plan(compose(o), 80, o) for o in (base, [*base, "float8_filter=all"]))
    gathered = {name: run["estimates"]["fsdp"]["gathered"] for name, run in (("auto", auto), ("all", every))}
    assert gathered["auto"] - gathered["all"] == 2 * kv  # two blocks gathered at once, k and v in 2 bytes
