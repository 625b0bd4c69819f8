"""Selective activation checkpointing (distributed/blocks.py `apply_ac`): each mode computes the gradients of no
checkpointing, and what it saves and recomputes lies between none and full, measured on a bare model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallama.distributed.blocks import apply_ac
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
MODES = {  # name: apply_ac's arguments
    "none": ("none", {}),
    "full": ("full", {}),
    "op": ("selective", {"policy": "op"}),
    "every_2": ("selective", {"policy": "every_n", "every_n": 2}),
}


def model(mode: str) -> Llama:
    torch.manual_seed(0)
    m = Llama(LlamaConfig(**CONFIG))
    name, kwargs = MODES[mode]
    apply_ac(m, name, **kwargs)
    return m


IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", ["full", "op", "every_2"])
def test_each_mode_computes_the_gradients_of_no_checkpointing(mode):
    plain, checkpointed = model("none"), model(mode)
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()
    for m in (plain, checkpointed):
        m(IDS).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=1e-6, msg=name)


MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}


class Measure(TorchDispatchMode):
    """Forward: every storage an op makes (weakly held: what is alive after forward is what the graph saved).
    Backward: the matmuls run (gradients' and recomputed forwards')."""

    def __init__(self):
        super().__init__()
        self.storages, self.matmuls = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.matmuls += func in MATMULS
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.storages.append(weakref.ref(t.untyped_storage()))
        return out

    def alive_bytes(self) -> int:
        gc.collect()
        alive = {s.data_ptr(): s.nbytes() for ref in self.storages if (s := ref()) is not None}
        return sum(alive.values())  # by address: views share a storage, and a freed address may be reused


def measured(mode: str) -> tuple[int, int]:
    """(bytes the forward leaves saved for backward, matmuls run in backward)."""
    m = model(mode)
    with Measure() as forward:
        loss = m(IDS).float().pow(2).mean()
    saved = forward.alive_bytes()
    with Measure() as backward:
        loss.backward()
    return saved, backward.matmuls


def test_selective_saves_less_than_none_and_recomputes_less_than_full():
    saved, matmuls = zip(*map(measured, MODES), strict=True)
    got = dict(zip(MODES, zip(saved, matmuls, strict=True), strict=True))
    none, full, op, every_2 = (got[k] for k in MODES)
    # bytes saved (seen: none 621,700, op 505,988, every_2 480,900, full 340,100)
    assert full[0] < op[0] < none[0] and full[0] < every_2[0] < none[0], got
    # 4 blocks of 7 linears, 2 matmuls each in backward (+ the head's 2). Full recomputes 6 per block: the
    # recomputation stops once it has what backward needs (down_proj's output is not needed).
    assert none[1] == 4 * 7 * 2 + 2 and full[1] == none[1] + 4 * 6, got
    assert op[1] == none[1], got  # selective (op) recomputes no matmul
    assert every_2[1] == none[1] + 2 * 6, got  # two of four blocks recomputed


@pytest.mark.parametrize(
    "overrides, matmuls",
    [
        ([], 0),
        (["activation_checkpointing=true"], 2 * 6),
        (["activation_checkpointing=full"], 2 * 6),
        (["activation_checkpointing=selective"], 0),
        (["activation_checkpointing=selective", "activation_checkpointing_policy.mode=every_n"], 6),
    ],
)
def test_the_config_reaches_the_plan(overrides, matmuls):
    """conf/train.yaml's keys, as parallama-train hands them to the module and the module to the strategy's plan:
    the matmuls backward recomputes in the tiny model (2 blocks) beyond those of no checkpointing."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from parallama import CONF_DIR
    from parallama.app.run import activation_checkpointing
    from parallama.training.module import CausalLM

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["model=tiny", "model.vocab_size=64", *overrides])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    counts = []
    for ac in (False, activation_checkpointing(cfg)):
        torch.manual_seed(0)
        module = CausalLM(model, {"lr": 1e-3}, {}, activation_checkpointing=ac)
        module.configure_model()
        loss = module.model(IDS).float().pow(2).mean()
        with Measure() as backward:
            loss.backward()
        counts.append(backward.matmuls)
    assert counts[1] - counts[0] == matmuls
