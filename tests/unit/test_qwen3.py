"""The Qwen3 family, built from the Llama's parts (its attention with QK-norm): transformers' logits both ways
(through the export and from a folder transformers wrote), tied and untied, head_dim independent of the width,
exact parameter counts (the real model's, parallama-plan's), and its tensor-parallel plan covering the q/k norms
(a 1-rank gloo mesh here; 2 ranks: tests/distributed/test_qwen3_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from test_model_seams import SHAPE as LLAMA_SHAPE
from test_model_seams import one_line
from test_plan import plans as estimate_plans
from test_plan import saved_bytes
from torch.distributed.tensor import DTensor

from parallama import CONF_DIR
from parallama.cli.plan import compose, plan
from parallama.distributed.dims import ParallelDims
from parallama.distributed.options import ParallelizeOptions
from parallama.errors import ConfigError
from parallama.models import model_spec, spec_for_hf_folder
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.hf import load_hf_config, load_hf_weights, save_hf_folder
from parallama.models.llama.model import Attention, Llama
from parallama.models.llama.parallelize import apply_tp
from parallama.models.llama.parallelize import parallelize as llama_parallelize
from parallama.models.qwen3 import Qwen3Config
from parallama.models.qwen3.model import Qwen3, Qwen3Attention
from parallama.models.qwen3.parallelize import qwen3_block_plan
from parallama.parallel.layouts import stage_params

SHAPE = {**LLAMA_SHAPE, "head_dim": 24}  # head_dim 24 != hidden_size / num_attention_heads = 16: its own


def qwen3(tie=False, seed=0, **overrides) -> Qwen3:
    """A Qwen3 with random weights, its norms too (all ones would hide a norm applied twice or not at all)."""
    torch.manual_seed(seed)
    return random_norms(Qwen3(Qwen3Config(**{**SHAPE, **overrides}, tie_word_embeddings=tie)).eval())


def random_norms(model):
    """The model with its norm weights drawn around 1 (all ones would hide a norm applied twice or not at all)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def real_qwen3(config: Qwen3Config) -> transformers.Qwen3ForCausalLM:
    """transformers' Qwen3 of the same shape (on the meta device: only its parameters' names and shapes)."""
    hf = transformers.Qwen3Config(**config.to_hf_dict())
    with torch.device("meta"):
        return transformers.Qwen3ForCausalLM(hf)


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_logits_equal_transformers_through_the_export(tmp_path, tie):
    ours = qwen3(tie)
    assert ours.layers["0"].self_attn.q_proj.weight.shape == (4 * 24, 64)  # heads x head_dim, not hidden
    save_hf_folder(tmp_path, ours.state_dict(), ours.config, None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs) is transformers.Qwen3ForCausalLM and theirs.config.head_dim == 24
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    want = logits(ours, ids)
    diff = (logits(theirs, ids) - want).abs().max().item()
    assert diff <= 1e-5, diff
    # the comparison sees the q/k norms: without them the logits are others
    with torch.no_grad():
        ours.layers["1"].self_attn.k_norm.weight.fill_(1.0)
    assert (logits(ours, ids) - want).abs().max() > 1e-2
    # and transformers' folder reads back into ours, by its model_type
    assert spec_for_hf_folder(tmp_path).family == "qwen3"
    back = Qwen3(load_hf_config(tmp_path, Qwen3Config))
    load_hf_weights(back, tmp_path)
    torch.testing.assert_close(logits(back, ids), want, atol=0, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_a_qwen3_folder_from_transformers_loads_into_ours(tmp_path, tie):
    """What init_from and model_dir= read: a folder transformers wrote (its rope_parameters, its tying)."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**SHAPE, "rms_norm_eps": 1e-6, "tie_word_embeddings": tie})
    theirs = random_norms(transformers.Qwen3ForCausalLM(config).eval())
    theirs.save_pretrained(tmp_path)
    spec = spec_for_hf_folder(tmp_path)
    ours = spec.model(spec.hf.load_hf_config(tmp_path, spec.config)).eval()
    assert ours.config.head_dim == 24 and ours.config.rope_theta == config.rope_parameters["rope_theta"]
    spec.hf.load_hf_weights(ours, tmp_path)
    ids = torch.randint(0, 320, (2, 24))
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["qwen3_tiny", "qwen3_0_6b"])
def test_num_params_is_the_real_models(preset):
    model = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml"))
    model["vocab_size"] = model["vocab_size"] or 320
    config = model_spec(model).build_config(model)
    assert config.head_dim != config.hidden_size // config.num_attention_heads
    real = sum(p.numel() for p in real_qwen3(config).parameters())
    assert config.num_params() == real
    if preset == "qwen3_0_6b":
        assert real == 596_049_920  # Qwen3-0.6B's parameter count
    else:
        assert config.num_params() == sum(p.numel() for p in Qwen3(config).parameters())
    assert {n for n, _ in real_qwen3(config).named_parameters()} == config.hf_keys()  # tied: no lm_head


def test_parallama_plan_counts_qwen3_0_6b_exactly():
    cfg = compose(["model=qwen3_0_6b", "trainer.devices=8"])
    result = plan(cfg, 80, ["model=qwen3_0_6b"])
    assert result["num_params"] == 596_049_920
    assert result["recommendation"] is not None
    # the N-D planner's share of a tp rank: the matmuls (heads x head_dim wide) and the vocabulary split, the
    # norms (the q/k norms too) whole, as the plan shards them
    config = model_spec(cfg.model).build_config(OmegaConf.to_container(cfg.model))
    assert stage_params(config, ParallelDims()) == 596_049_920
    model = Qwen3(Qwen3Config(**{**SHAPE, "tie_word_embeddings": True}))
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    want = (sum(p.numel() for p in model.parameters()) - norms) // 2 + norms
    assert stage_params(model.config, ParallelDims(tp=2)) == want


def test_saved_activation_bytes_match_the_planners_estimate():
    """test_plan.py's measurement on a Qwen3 (head_dim 24 != 64 / 4; the q/k norms' inputs counted). CPU runs
    RMSNorm unfused, which also saves each normalized input: 2h + q + kv more per layer and token (~20% here)."""
    config = Qwen3Config(**{**SHAPE, "num_hidden_layers": 4})
    ids = torch.randint(0, 320, (2, 128), generator=torch.Generator().manual_seed(0))
    measured = saved_bytes(Qwen3(config), ids)
    expected = estimate_plans(config, seq_len=128)["ddp"].activations
    assert 1.0 <= measured / expected < 1.25, measured / expected


def test_a_bad_head_dim_is_one_line():
    with pytest.raises(ValueError, match=r"^model.head_dim=23 must be even \(rope\)$"):
        Qwen3Config(**{**SHAPE, "head_dim": 23})
    with pytest.raises(ValueError, match="model.head_dim=0 must be a positive int"):
        Qwen3Config(**{**SHAPE, "head_dim": 0})


def test_export_refuses_a_qwen3_as_a_llama_and_a_missing_norm(tmp_path):
    """A Qwen3 state dict exported under a Llama's config has norms the Llama's checkpoint has no place for; one
    missing a norm would have transformers initialize it: both refused in one line, naming the tensor."""
    q = qwen3()
    llama_config = LlamaConfig(**LLAMA_SHAPE)
    with pytest.raises(ConfigError) as excinfo:
        save_hf_folder(tmp_path / "hf", q.state_dict(), llama_config, None)
    one_line(excinfo, "layers.0.self_attn.k_norm.weight (and 3 more)", "LlamaForCausalLM")
    state = q.state_dict()
    del state["layers.0.self_attn.q_norm.weight"]
    with pytest.raises(ConfigError) as excinfo:
        save_hf_folder(tmp_path / "hf", state, q.config, None)
    one_line(excinfo, "model.layers.0.self_attn.q_norm.weight", "Qwen3ForCausalLM")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_qwen3_tp_plan_covers_the_qk_norms(one_rank_mesh, sequence_parallel):
    """Every parameter a DTensor on the tp mesh (the norms between blocks excepted without SP), and the same
    logits and gradients as the plain model."""
    plain, model = qwen3(), qwen3()
    apply_tp(model, one_rank_mesh["tp"], sequence_parallel=sequence_parallel, block_plan=qwen3_block_plan)
    plain_only = {n for n, p in model.named_parameters() if not isinstance(p, DTensor)}
    assert all("layernorm" in n or n == "norm.weight" for n in plain_only) and len(plain_only) == (
        0 if sequence_parallel else 5
    )
    assert isinstance(model.layers["0"].self_attn.q_norm.weight, DTensor)
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(2))
    for m in (plain, model):
        m(ids).float().square().mean().backward()
    torch.testing.assert_close(model(ids).detach(), plain(ids).detach())
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad, msg=name)


def test_the_llama_plan_on_a_qwen3_is_refused(one_rank_mesh):
    """The found bug: per-head norms a plan missed trained each tp rank's own copy. Refused in one line."""
    options = ParallelizeOptions(dims=ParallelDims(tp=2), mesh={"tp": one_rank_mesh["tp"]})
    with pytest.raises(ConfigError) as excinfo:
        llama_parallelize(qwen3(), options)  # the Llama's plan on a Qwen3: q_norm and k_norm uncovered
    one_line(excinfo, "layers.0.self_attn.q_norm.weight", "not covered by the tensor-parallel plan")


def test_qwen3_is_the_llama_with_two_norms_per_layer():
    """Its blocks are the Llama's (the MLP the same class), its attention the Llama's plus q_norm and k_norm."""
    assert Qwen3.decoder_layer.attention is Qwen3Attention and issubclass(Qwen3Attention, Attention)
    assert Qwen3.decoder_layer.feed_forward is Llama.decoder_layer.feed_forward
    names = [n for n, _ in qwen3().layers["0"].named_parameters()]
    llama_names = [n for n, _ in Llama(LlamaConfig(**LLAMA_SHAPE)).layers["0"].named_parameters()]
    assert names == [*llama_names[:5], "self_attn.q_norm.weight", "self_attn.k_norm.weight", *llama_names[5:]]
