"""optimizer=muon (training/muon.py): Muon for the matrices inside the model contract's blocks, AdamW for the rest,
on the Llama and on Qwen3; one step of the combined optimizer is torch's Muon and AdamW run separately (bit for
bit given torch's orthogonalization; to bf16's rounding with the batched one); its state dict round-trips
through a checkpoint file. The batched Newton-Schulz iteration (newton_schulz.py)
gives each matrix torch's one-by-one result; the shares of the matrices (muon_share.py) are even and balanced; the
AdamW side is fused as optimizer.fused is. Each rank's share on 4 ranks: tests/distributed/test_muon_share.py;
every layout trains it as one process does: tests/distributed/test_recipe.py; resumed:
tests/integration/test_muon_resume.py; compiled: tests/integration/test_muon_compile.py."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from omegaconf import OmegaConf

from parallama import CONF_DIR
from parallama.errors import ConfigError
from parallama.training import muon_share, newton_schulz
from parallama.training.module import CausalLM
from parallama.training.muon import MuonAdamW, mark_hidden_matrices
from parallama.training.muon_share import shares
from parallama.training.newton_schulz import iteration_flops, orthogonalize
from parallama.training.optim import check_optimizer, optimizer_factory, with_fused_default

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


@pytest.mark.parametrize("iteration", ["torchs", "batched"])
def test_one_step_is_torchs_muon_and_adamw_run_separately(iteration, monkeypatch):
    """Given torch's own one-by-one orthogonalization, the rest of the step (momentum, Nesterov, the learning rate's
    adjustment, decoupled decay, the AdamW side) is torch's bit for bit on any CPU. Batched, the bf16 GEMMs of a
    stack of matrices may round otherwise than torch's on a transposed view: equal on the Intel Xeon VMs, up to
    1.2e-4 after these three steps on an AVX2 EPYC (Milan), which move the weights by up to 0.03 (momentum 0.85
    for 0.9 fails both variants)."""
    if iteration == "torchs":
        torchs = torch.optim._muon._zeropower_via_newtonschulz
        monkeypatch.setattr(
            muon_share,
            "orthogonalize",
            lambda updates, coefficients, steps, eps, *_: [
                torchs(u, coefficients, steps, eps) for u in updates
            ],
        )
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
        ns_method="standard",
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
        if iteration == "torchs":
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=2e-4, msg=name)
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


COEFFICIENTS, STEPS, EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7
# Llama's shapes in small: q/o, k/v, gate/up (tall: taken as their transpose) and down (wide), and a square one
SHAPES = [(16, 16), (16, 16), (4, 16), (4, 16), (64, 16), (64, 16), (16, 64), (8, 8)]


def one_by_one(update, dtype):
    """torch.optim.Muon's `_zeropower_via_newtonschulz` (torch/optim/_muon.py) on one matrix, in `dtype`."""
    a, b, c = COEFFICIENTS
    x = update.to(dtype)
    if update.size(0) > update.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=EPS))
    for _ in range(STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if update.size(0) > update.size(1) else x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_gives_each_matrix_its_one_by_one_result(dtype, monkeypatch):
    """Same-shape matrices (tall ones transposed) go through one batch, each normalized by its own norm (one is
    1000x the others: a shared norm would shrink them): the results are torch's per matrix, to fp32's rounding;
    in bf16, torch's own function's (its bf16 GEMMs one matrix at a time)."""
    generator = torch.Generator().manual_seed(0)
    updates = [torch.randn(shape, generator=generator) for shape in SHAPES]
    updates[1] = updates[1] * 1000
    batches = []
    iterate = newton_schulz.newton_schulz
    monkeypatch.setattr(
        newton_schulz, "newton_schulz", lambda x, *a: batches.append(x.shape) or iterate(x, *a)
    )
    results = orthogonalize(updates, COEFFICIENTS, STEPS, EPS, dtype, "standard")
    assert sorted(batches) == [(1, 8, 8), (2, 4, 16), (2, 16, 16), (3, 16, 64)]
    torchs = getattr(torch.optim._muon, "_zeropower_via_newtonschulz", None)
    for update, result in zip(updates, results):
        assert result.shape == update.shape and result.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(result, one_by_one(update, dtype), rtol=0, atol=1e-6)
        else:
            expected = torchs(update, COEFFICIENTS, STEPS, EPS) if torchs else one_by_one(update, dtype)
            torch.testing.assert_close(result.float(), expected.float(), rtol=0, atol=1e-2)


def test_shares_split_each_set_evenly_and_balance_the_rest():
    costs = [iteration_flops(16, 64, STEPS), iteration_flops(16, 16, STEPS), iteration_flops(4, 16, STEPS)]
    for counts, world in (([48, 32, 32], 8), ([3, 2, 2], 4), ([1, 1, 1], 2), ([0, 5, 1], 3)):
        split = shares(counts, costs, world)
        assert [sum(s) for s in split] == counts
        assert all(max(s) - min(s) <= 1 for s in split)  # even within a set
        load = [sum(s[r] * c for s, c in zip(split, costs)) for r in range(world)]
        biggest = max(c for c, n in zip(costs, counts) if n)
        assert max(load) - min(load) <= biggest  # the remainders go to the ranks with least work
        assert shares(counts, costs, world) == split  # every rank computes the same
    assert shares([3, 1], [10, 10], 2) == [[2, 1], [0, 1]]


def test_the_adamw_side_is_fused_as_optimizer_fused_is():
    """`adamw_fused: null` is resolved as AdamW's `fused: null` (on a GPU, unless fp16's loss scaler), and a
    fused AdamW side steps as the unfused one."""

    def fused(value, **where):
        factory = functools.partial(MuonAdamW, adamw_fused=value)
        return with_fused_default(factory, **where).keywords["adamw_fused"]

    assert fused(None, on_gpu=True, loss_scaled=False, clipping=True)
    assert not fused(None, on_gpu=True, loss_scaled=True, clipping=True)
    assert not fused(None, on_gpu=False, loss_scaled=False, clipping=True)
    with pytest.raises(
        ConfigError, match=r"^optimizer.adamw_fused=true with trainer.precision=16-mixed .*; set "
    ):
        fused(True, on_gpu=True, loss_scaled=True, clipping=True)
    with pytest.raises(
        ConfigError, match=r"^optimizer.adamw_fused=maybe is not valid; use true, false or null$"
    ):
        check_optimizer({**MUON, "adamw_fused": "maybe"})

    models = [module("tiny").model, module("tiny").model]
    optimizers = [
        MuonAdamW(mark_hidden_matrices([{"params": list(m.parameters())}], m), adamw_fused=f)
        for m, f in zip(models, (False, True))
    ]
    assert [o._adamw.defaults["fused"] for o in optimizers] == [False, True]
    for step in range(2):
        for model, optimizer in zip(models, optimizers):
            fill_grads(model, step)
            optimizer.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 6])
def test_the_gram_iteration_gives_the_standard_result(steps):
    """`ns_method=gram` (Gram Newton-Schulz) is the standard iteration rewritten on X X^T: in fp32 the same result
    to rounding, with its restart (more than 2 steps) and without; in bf16 about as far from that as the standard's
    own bf16 result is (measured: 1.4-1.7x)."""
    generator = torch.Generator().manual_seed(steps)
    for shape in ((3, 16, 64), (2, 4, 16), (1, 8, 8)):
        batch = torch.randn(shape, generator=generator)
        exact = newton_schulz.newton_schulz(batch, COEFFICIENTS, steps, EPS, torch.float32)
        gram = newton_schulz.gram_newton_schulz(batch, COEFFICIENTS, steps, EPS, torch.float32)
        torch.testing.assert_close(gram, exact, rtol=0, atol=1e-5)
        gram_bf16 = newton_schulz.gram_newton_schulz(batch, COEFFICIENTS, steps, EPS, torch.bfloat16)
        standard_bf16 = newton_schulz.newton_schulz(batch, COEFFICIENTS, steps, EPS, torch.bfloat16)
        assert gram_bf16.dtype == torch.bfloat16
        assert (gram_bf16.float() - exact).abs().max() <= 3 * (standard_bf16.float() - exact).abs().max()


def test_gram_takes_the_non_square_batches_and_a_third_fewer_flops(monkeypatch):
    """Square matrices gain nothing from the Gram matrix: they keep the standard iteration. At 4:1 (Llama's MLP, k
    and v) five steps cost 60 m^3 FLOPs against 90 m^3."""
    generator = torch.Generator().manual_seed(0)
    updates = [torch.randn(shape, generator=generator) for shape in SHAPES]
    ran = []
    for name in ("newton_schulz", "gram_newton_schulz"):
        iterate = getattr(newton_schulz, name)
        monkeypatch.setattr(
            newton_schulz,
            name,
            lambda x, *a, name=name, iterate=iterate: ran.append((name, *x.shape)) or iterate(x, *a),
        )
    results = orthogonalize(updates, COEFFICIENTS, STEPS, EPS, torch.float32, method="gram")
    assert sorted(ran) == [
        ("gram_newton_schulz", 2, 4, 16),
        ("gram_newton_schulz", 3, 16, 64),
        ("newton_schulz", 1, 8, 8),
        ("newton_schulz", 2, 16, 16),
    ]
    for update, result in zip(updates, results):
        torch.testing.assert_close(result, one_by_one(update, torch.float32), rtol=0, atol=1e-5)
    m = 2048
    assert iteration_flops(m, 4 * m, 5, "gram") == 60 * m**3
    assert iteration_flops(4 * m, m, 5) == 90 * m**3
    assert iteration_flops(m, m, 5, "gram") == iteration_flops(m, m, 5)


def test_a_gram_step_and_a_resume_that_changes_the_iteration(monkeypatch):
    """optimizer.ns_method=gram steps as the standard one does, to fp32's rounding. How the iteration computes is the
    run's configuration, not optimizer state: a state dict of the standard iteration in bf16 (or of a checkpoint
    written before ns_method existed) resumes as configured. A bad value is one line."""
    models = [module("tiny").model, module("tiny").model]
    optimizers = [
        MuonAdamW(
            mark_hidden_matrices([{"params": list(m.parameters())}], m), ns_dtype="float32", ns_method=k
        )
        for m, k in zip(models, ("standard", "gram"))
    ]
    for model, optimizer in zip(models, optimizers):
        fill_grads(model, 0)
        optimizer.step()
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    bf16 = MuonAdamW(
        mark_hidden_matrices([{"params": list(models[0].parameters())}], models[0]), ns_method="standard"
    )
    bf16.load_state_dict(optimizers[0].state_dict())
    old = bf16.state_dict()
    assert all("ns_method" not in g for g in old["param_groups"])
    optimizers[1].load_state_dict(old)
    ran = []
    iterate = newton_schulz.gram_newton_schulz
    monkeypatch.setattr(
        newton_schulz, "gram_newton_schulz", lambda x, *a: ran.append(a[-1]) or iterate(x, *a)
    )
    fill_grads(models[1], 1)
    optimizers[1].step()
    assert ran and set(ran) == {torch.float32}  # gram, in fp32, as configured
    with pytest.raises(ConfigError, match=r"^optimizer.ns_method=fast is not valid; use standard or gram$"):
        check_optimizer({**MUON, "ns_method": "fast"})
