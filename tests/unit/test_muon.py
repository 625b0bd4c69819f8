"""optimizer=muon (training/muon.py): Muon for the matrices inside the model contract's blocks, AdamW for the rest,
on the Llama and on Qwen3; one step of the combined optimizer is torch's Muon and AdamW run separately, bit for
bit; its state dict round-trips through a checkpoint file. Every layout trains it as one process does:
tests/distributed/test_recipe.py; resumed: tests/integration/test_muon_resume.py."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from parallama import CONF_DIR
from parallama.errors import ConfigError
from parallama.training.module import CausalLM
from parallama.training.muon import MuonAdamW, mark_hidden_matrices
from parallama.training.optim import optimizer_factory

MUON = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "optimizer" / "muon.yaml"))
SCHEDULER = {"_target_": "parallama.training.schedules.Constant"}
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def module(preset: str, **model) -> CausalLM:
    config = {**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml")), **model}
    config["vocab_size"] = 128
    torch.manual_seed(0)
    lm = CausalLM(model=config, optimizer=MUON, scheduler=SCHEDULER)
    lm.configure_model()
    return lm


def names(model, params) -> set[str]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return {name_of[id(p)] for p in params}


@pytest.mark.parametrize("preset", ["tiny", "qwen3_tiny"])
def test_muon_gets_the_blocks_matrices_and_adamw_the_rest(preset):
    lm = module(preset)
    optimizer = optimizer_factory(MUON)(mark_hidden_matrices(lm.param_groups(), lm.model))
    assert isinstance(optimizer, MuonAdamW)
    muon, embeddings_head, norms = optimizer.param_groups
    assert (muon["muon"], embeddings_head["muon"], norms["muon"]) == (True, False, False)
    layers = lm.config.num_hidden_layers
    assert names(lm.model, muon["params"]) == {
        f"layers.{i}.{part}.{proj}.weight"
        for i in range(layers)
        for part, projs in (("self_attn", PROJECTIONS - {"gate_proj", "up_proj", "down_proj"}),)
        + (("mlp", {"gate_proj", "up_proj", "down_proj"}),)
        for proj in projs
    }
    assert names(lm.model, embeddings_head["params"]) == {"embed_tokens.weight", "lm_head.weight"}
    norm_names = names(lm.model, norms["params"])
    assert all(n.endswith("norm.weight") for n in norm_names)
    if preset == "qwen3_tiny":  # QK-norm: vectors inside the blocks stay AdamW's
        assert f"layers.{layers - 1}.self_attn.q_norm.weight" in norm_names
    assert norms["weight_decay"] == 0.0 and embeddings_head["weight_decay"] == 0.1
    assert muon["adjust_lr_fn"] == "match_rms_adamw" and embeddings_head["betas"] == (0.9, 0.99)
    total = sum(len(g["params"]) for g in optimizer.param_groups)
    assert total == len(list(lm.model.parameters()))


def fill_grads(model, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


def test_one_step_is_torchs_muon_and_adamw_run_separately():
    lm = module("tiny")
    ours_model, torch_model = lm.model, copy.deepcopy(lm.model)
    keys = dict(lr=2e-2, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5)
    ours = MuonAdamW(
        mark_hidden_matrices(lm.param_groups(), ours_model),
        **keys,
        adjust_lr="original",
        adamw_lr=1e-2,
        adamw_betas=[0.8, 0.95],
        adamw_eps=1e-6,
        adamw_weight_decay=0.05,
    )
    hidden = [p for p in torch_model.layers.parameters() if p.ndim == 2]
    ids = {id(p) for p in hidden}
    rest = [p for p in torch_model.parameters() if id(p) not in ids]
    muon = torch.optim.Muon(hidden, **keys, adjust_lr_fn="original")
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.ndim == 2]},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.8, 0.95),
        eps=1e-6,
        weight_decay=0.05,
    )
    for step in range(3):
        fill_grads(ours_model, step)
        fill_grads(torch_model, step)
        ours.step()
        muon.step()
        adamw.step()
        ours.zero_grad()
    for (name, a), b in zip(ours_model.named_parameters(), torch_model.parameters()):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in ours_model.parameters())  # zero_grad covers both sides
    start = module("tiny").model
    assert max((a - b).abs().max() for a, b in zip(ours_model.parameters(), start.parameters())) > 1e-3


def test_the_state_dict_round_trips_through_a_file(tmp_path):
    lm, again = module("tiny"), module("tiny")
    factory = optimizer_factory(MUON)
    optimizer = factory(mark_hidden_matrices(lm.param_groups(), lm.model))
    for step in range(2):
        fill_grads(lm.model, step)
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    again.model.load_state_dict(lm.model.state_dict())
    resumed = factory(mark_hidden_matrices(again.param_groups(), again.model))
    resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    state = resumed.state_dict()
    assert {k for s in state["state"].values() for k in s} == {
        "momentum_buffer",
        "step",
        "exp_avg",
        "exp_avg_sq",
    }
    for model, opt in ((lm.model, optimizer), (again.model, resumed)):
        fill_grads(model, 2)
        opt.step()
    for (name, a), b in zip(lm.model.named_parameters(), again.model.parameters()):
        assert torch.equal(a, b), name


def test_groups_must_say_whose_they_are():
    with pytest.raises(ValueError, match="marked muon=true/false"):
        MuonAdamW([torch.nn.Parameter(torch.ones(2, 2))])


def test_the_state_of_another_optimizer_is_refused_in_one_line():
    lm = module("tiny")
    adamw = torch.optim.AdamW(lm.param_groups())
    muon = optimizer_factory(MUON)(mark_hidden_matrices(lm.param_groups(), lm.model))
    with pytest.raises(ConfigError, match="^the checkpoint's optimizer state is not optimizer=muon's"):
        muon.load_state_dict(adamw.state_dict())
