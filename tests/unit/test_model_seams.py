"""The Llama at its seams: its parts are class attributes a family replaces without copying the model, and the
two places that must cover every parameter or refuse in one line: the Hugging Face export and the
tensor-parallel plan (a 1-rank gloo mesh here)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from parallama import CONF_DIR, models
from parallama.errors import ConfigError
from parallama.models import model_spec, spec_for_hf_folder
from parallama.models.contract import parameter_count_note
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.hf import save_hf_folder
from parallama.models.llama.model import Attention, DecoderLayer, Llama
from parallama.models.llama.parallelize import apply_tp

SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_export_refuses_a_parameter_the_hf_mapping_does_not_know(tmp_path):
    """transformers drops a tensor its model has no place for (logits off, silently): export refuses it."""
    model = Llama(LlamaConfig(**SHAPE))
    model.layers["1"].self_attn.register_parameter("scale", nn.Parameter(torch.ones(4)))
    with pytest.raises(ConfigError) as excinfo:
        save_hf_folder(tmp_path / "hf", model.state_dict(), model.config, None)
    one_line(excinfo, "layers.1.self_attn.scale", "LlamaForCausalLM")
    assert not (tmp_path / "hf").exists()
    state = Llama(LlamaConfig(**SHAPE)).state_dict()
    del state["layers.0.mlp.up_proj.weight"]
    with pytest.raises(ConfigError) as excinfo:
        save_hf_folder(tmp_path / "hf", state, model.config, None)
    one_line(excinfo, "model.layers.0.mlp.up_proj.weight", "initialize it at random")


def test_a_parameter_the_tp_plan_does_not_cover_is_refused(one_rank_mesh):
    model = Llama(LlamaConfig(**SHAPE))
    model.layers["1"].mlp.register_parameter("gain", nn.Parameter(torch.ones(64)))
    with pytest.raises(ConfigError) as excinfo:
        apply_tp(model, one_rank_mesh["tp"])
    one_line(excinfo, "layers.1.mlp.gain", "tensor-parallel plan")
    apply_tp(Llama(LlamaConfig(**SHAPE)), one_rank_mesh["tp"])  # the Llama's own plan covers all of it


def test_a_family_replaces_one_part_without_copying_the_model():
    class Scaled(Attention):
        def project(self, x):
            q, k, v = super().project(x)
            return 2 * q, k, v

    class Layer(DecoderLayer):
        attention = Scaled

    class Model(Llama):
        decoder_layer = Layer

    torch.manual_seed(0)
    model = Model(LlamaConfig(**SHAPE))
    plain = Llama(LlamaConfig(**SHAPE))
    plain.load_state_dict(model.state_dict())
    assert (
        isinstance(model.layers["0"].self_attn, Scaled)
        and model.layers["0"].mlp.__class__ is DecoderLayer.feed_forward
    )
    ids = torch.randint(0, 320, (1, 12))
    assert not torch.allclose(model(ids), plain(ids))


def test_the_model_contract_is_checked_with_one_line_naming_what_is_missing():
    """models/contract.py: a model without the blocks' keyed dict or the names of its ends, or a config without
    what the planner reads, is refused when built, naming the members."""
    from parallama.models import ModelSpec
    from parallama.models.contract import DecoderModel, check_model

    check_model(Llama(LlamaConfig(**SHAPE)), "llama")
    assert isinstance(Llama(LlamaConfig(**SHAPE)), DecoderModel)

    class Plain(nn.Module):  # a decoder written without the contract
        def __init__(self, config):
            super().__init__()
            self.config, self.blocks = config, nn.ModuleList()

        def forward(self, input_ids):
            return input_ids

    with pytest.raises(ConfigError) as err:
        check_model(Plain(LlamaConfig(**SHAPE)), "plain")
    one_line(
        err, "model.family=plain: Plain lacks", "init_weights", "input_modules", "layers", "new_kv_cache"
    )

    class BareConfig:
        def __init__(self, **fields):
            self.__dict__.update(fields)

    spec = ModelSpec("bare", BareConfig, "x.Model", "x.parallelize")
    with pytest.raises(ConfigError) as err:
        spec.build_config(SHAPE)
    one_line(
        err,
        "model.family=bare: BareConfig lacks",
        "block_params",
        "head_dim",
        "num_params",
        "tied_parameters",
    )


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
def test_each_presets_config_counts_the_parameters_its_model_has(preset):
    """FLOPs per token, MFU and parallama-plan read the config's count: it must be the built model's."""
    fields = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml"), resolve=True)
    fields["vocab_size"] = fields.get("vocab_size") or 320
    spec = model_spec(fields)
    with torch.device("meta"):
        model = spec.model(spec.build_config(fields))
    assert parameter_count_note(model, spec.family) is None


def test_a_block_whose_parameters_change_without_its_config_is_named():
    """A GELU MLP without the gate (found by a user's walk through docs/architecture.md: 869,504 counted for
    672,896 built) is one line with both counts, which parallama-train logs."""

    class GeluMLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        def forward(self, x):
            return self.down_proj(nn.functional.gelu(self.up_proj(x)))

    class Layer(DecoderLayer):
        feed_forward = GeluMLP

    class Model(Llama):
        decoder_layer = Layer

    model = Model(LlamaConfig(**SHAPE))
    gates = 2 * 64 * 128
    note = parameter_count_note(model, "gelu")
    counted = LlamaConfig(**SHAPE).num_params()
    assert note.startswith(f"model.family=gelu: LlamaConfig.num_params() counts {counted:,} parameters")
    assert f"Model has {counted - gates:,}" in note and "block_params" in note and "\n" not in note


def test_a_folder_no_family_reads_is_one_line_naming_those_that_do(tmp_path, monkeypatch):
    """Also with a family of the user's that has no Hugging Face conversion (its hf_model_type None)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError) as err:
        spec_for_hf_folder(tmp_path)
    one_line(err, "model_type='gpt2', which no family reads; supported: llama, qwen3, qwen3_moe")
    llama = model_spec({"family": "llama"})
    mine = dataclasses.replace(llama, family="mine", hf_path=None, hf_model_type=None)
    monkeypatch.setattr(models, "families", lambda: ["llama", "mine"])
    monkeypatch.setattr(models, "model_spec", lambda f: mine if f["family"] == "mine" else llama)
    with pytest.raises(ConfigError) as err:
        spec_for_hf_folder(tmp_path)
    one_line(err, "which no family reads; supported: llama")
