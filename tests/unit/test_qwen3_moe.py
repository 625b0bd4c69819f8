"""The Qwen3-MoE family: transformers' Qwen3MoeForCausalLM logits both ways (through the export's per-expert
files, and from a folder transformers wrote), sparse and dense blocks mixed (`mlp_only_layers`,
`decoder_sparse_step`), exact total parameter counts (Qwen3-30B-A3B's), and what export refuses."""

from __future__ import annotations

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from test_model_seams import one_line
from test_qwen3 import logits, random_norms

from parallama import CONF_DIR
from parallama.errors import ConfigError
from parallama.models import model_spec, spec_for_hf_folder
from parallama.models.llama.model import MLP
from parallama.models.moe import MoE
from parallama.models.qwen3_moe import Qwen3MoeConfig
from parallama.models.qwen3_moe.hf import load_hf_config, load_hf_weights, save_hf_folder
from parallama.models.qwen3_moe.model import Qwen3Moe

SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    num_experts=8,
    num_experts_per_tok=2,
    decoder_sparse_step=1,
    mlp_only_layers=[2],
)


def qwen3_moe(seed=0, **overrides) -> Qwen3Moe:
    """Random weights, the norms too (all ones would hide a norm applied twice or not at all)."""
    torch.manual_seed(seed)
    return random_norms(Qwen3Moe(Qwen3MoeConfig(**{**SHAPE, **overrides})).eval())


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_equal_transformers_through_the_export(tmp_path, norm_topk_prob):
    ours = qwen3_moe(norm_topk_prob=norm_topk_prob)
    assert [type(layer.mlp) for layer in ours.layers.values()] == [MoE, MoE, MLP, MoE]
    save_hf_folder(tmp_path, ours.state_dict(), ours.config, None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs) is transformers.Qwen3MoeForCausalLM
    assert theirs.config.norm_topk_prob is norm_topk_prob and theirs.config.mlp_only_layers == [2]
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    want = logits(ours, ids)
    diff = (logits(theirs, ids) - want).abs().max().item()
    assert diff <= 1e-5, diff
    with torch.no_grad():  # the comparison sees the experts: another expert's weights, other logits
        ours.layers["1"].mlp.experts.down_proj[3].mul_(2)
    assert (logits(ours, ids) - want).abs().max() > 1e-3
    assert spec_for_hf_folder(tmp_path).family == "qwen3_moe"
    back = Qwen3Moe(load_hf_config(tmp_path, Qwen3MoeConfig))
    load_hf_weights(back, tmp_path)
    torch.testing.assert_close(logits(back, ids), want, atol=0, rtol=0)


def test_a_folder_transformers_wrote_loads_into_ours(tmp_path):
    """What init_from reads: a folder from transformers' save_pretrained (per-expert tensors on disk)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**SHAPE, "decoder_sparse_step": 2, "mlp_only_layers": []})
    theirs = transformers.Qwen3MoeForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    spec = spec_for_hf_folder(tmp_path)
    ours = spec.model(spec.hf.load_hf_config(tmp_path, spec.config)).eval()
    assert [type(layer.mlp) for layer in ours.layers.values()] == [MLP, MoE, MLP, MoE]
    spec.hf.load_hf_weights(ours, tmp_path)
    ids = torch.randint(0, 320, (2, 24))
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["qwen3_moe_tiny", "qwen3_moe_30b_a3b"])
def test_num_params_is_the_real_models(preset):
    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml"))
    model["vocab_size"] = model["vocab_size"] or 320
    config = model_spec(model).build_config(model)
    hf = transformers.Qwen3MoeConfig(**config.to_hf_dict())
    with torch.device("meta"):
        real, ours = transformers.Qwen3MoeForCausalLM(hf), Qwen3Moe(config)
    assert config.num_params() == sum(p.numel() for p in real.parameters())
    assert config.num_params() == sum(p.numel() for p in ours.parameters())
    experts = sum(p.numel() for n, p in ours.named_parameters() if ".experts." in n)
    idle = experts * (1 - config.num_experts_per_tok / config.num_experts)
    assert config.active_params() == config.num_params() - idle
    if preset == "qwen3_moe_30b_a3b":
        assert config.num_params() == 30_532_122_624  # Qwen3-30B-A3B's, "30.5B in total, 3.3B activated"


def test_export_refuses_what_transformers_would_run_otherwise(tmp_path):
    biased = qwen3_moe(router_bias_update_rate=0.01)
    with pytest.raises(ConfigError) as excinfo:
        save_hf_folder(tmp_path / "hf", biased.state_dict(), biased.config, None)
    one_line(excinfo, "layers.0.mlp.gate.expert_bias (and 2 more)", "Qwen3MoeForCausalLM")
    sigmoid = qwen3_moe(router_score_func="sigmoid")
    with pytest.raises(ConfigError) as excinfo:
        save_hf_folder(tmp_path / "hf", sigmoid.state_dict(), sigmoid.config, None)
    one_line(excinfo, "model.router_score_func=sigmoid")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ({"num_experts_per_tok": 9}, "model.num_experts_per_tok=9 must be <= model.num_experts=8"),
        ({"mlp_only_layers": [4]}, r"model.mlp_only_layers has 4; use layer indices in \[0, 4\)"),
        ({"router_aux_loss_coef": -1}, "model.router_aux_loss_coef=-1 must be a number >= 0"),
        ({"router_score_func": "relu"}, "model.router_score_func='relu'"),
    ],
)
def test_bad_moe_fields_are_one_line(override, message):
    with pytest.raises(ValueError, match=message):
        Qwen3MoeConfig(**{**SHAPE, **override})


def test_parallama_plan_counts_total_and_active_and_what_ep_gathers():
    """Total and active parameters; under tp the experts whole on every rank; under ep an FSDP rank gathers
    E/ep of a block's experts (the working set's two blocks)."""
    from parallama.cli.plan import compose, plan
    from parallama.distributed.dims import ParallelDims
    from parallama.parallel.layouts import Layout, estimate_layout, stage_params

    args = ["model=qwen3_moe_30b_a3b", "trainer.devices=8", "strategy=model_parallel", "strategy.ep=8"]
    result = plan(compose(args), 80, args)
    assert (result["num_params"], result["active_params"]) == (30_532_122_624, 3_353_032_704)
    config = Qwen3MoeConfig(**SHAPE)
    experts = sum(p.numel() for n, p in Qwen3Moe(config).layers["0"].named_parameters() if ".experts." in n)
    whole, tp2 = stage_params(config, ParallelDims()), stage_params(config, ParallelDims(tp=2))
    assert 3 * config.moe_params() < tp2 < whole  # a tp rank holds the 3 sparse blocks' routers and experts
    shape = dict(seq_len=64, micro_batch=2, precision="32-true", activation_checkpointing=False)
    fsdp = estimate_layout(config, Layout(ParallelDims(dp_shard=4)), **shape)
    ep = estimate_layout(config, Layout(ParallelDims(dp_shard=4, ep=4)), **shape)
    assert fsdp.gathered - ep.gathered == 2 * (experts - experts // 4) * 4  # two blocks, fp32
