"""`activation_checkpointing=selective` under every strategy group: auto (one process, the reference), fsdp on
2 ranks and model_parallel tp=2 (the checkpointed blocks hold DTensors) end with the same weights after 3 steps
(1e-5), read through parallama-export (the every_n policy's gradients: tests/unit/test_selective_ac.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import layout_weights

pytestmark = pytest.mark.multiprocess

COMMON = [
    "scheduler=constant",
    "optimizer.lr=3e-4",
    "trainer.precision=32-true",
    "trainer.max_steps=3",
    "seed=7",
    "trainer.limit_val_batches=0",
    "validate_before_training=false",
    "sample.max_new_tokens=0",
    "activation_checkpointing=selective",
]
LAYOUTS = {  # name: (ranks, per-rank batch, overrides)
    "auto": (1, 8, []),
    "fsdp": (2, 4, ["strategy=fsdp"]),
    "tp": (2, 8, ["strategy=model_parallel", "strategy.tp=2"]),
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory, data_cache) -> dict:
    tmp = tmp_path_factory.mktemp("selective_ac")
    out = {}
    for layout, (ranks, batch, args) in LAYOUTS.items():
        out[layout] = layout_weights(
            tmp / layout, *COMMON, *args, ranks=ranks, batch=batch, cwd=tmp, cache=data_cache
        )
    return out


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_selective_checkpointing_trains_as_one_process(layout, weights):
    actual, expected = weights[layout], weights["auto"]
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)
