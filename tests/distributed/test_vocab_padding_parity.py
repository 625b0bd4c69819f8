"""A vocabulary of 300, whose head's matmul one process pads to 320 in training (models/llama `Llama.logits`),
trains as the unpadded head does, one process (`model.pad_vocab_multiple=1`), under FSDP2 (2 ranks: the padded
matmul on the gathered weight), tensor parallel (tp=2: the head's weight a DTensor, its matmul unpadded and
vocab-sharded, 150 columns a rank), the pipeline (pp=2: padded on the last stage) and context parallel (cp=2): the
same weights after 3 steps (1e-5), all exported with vocab_size=300.
One set of runs, shared by the tests below; the LR is constant and low (see test_model_parallel.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import layout_weights

pytestmark = pytest.mark.multiprocess

COMMON = [
    "model.vocab_size=300",
    "scheduler=constant",
    "optimizer.lr=3e-4",
    "trainer.precision=32-true",
    "trainer.gradient_clip_val=0.5",
    "trainer.max_steps=3",
    "seed=7",
    "trainer.limit_val_batches=0",
    "validate_before_training=false",
    "sample.max_new_tokens=0",
]
PAD = "model.pad_vocab_multiple=64"
LAYOUTS = {  # name: (ranks, per-rank batch, overrides); each trains on the global batch 8
    "padded": (1, 8, [PAD]),
    "unpadded": (1, 8, ["model.pad_vocab_multiple=1"]),
    "fsdp": (2, 4, [PAD, "strategy=fsdp"]),
    "tp": (2, 8, [PAD, "strategy=model_parallel", "strategy.tp=2"]),
    "pp": (2, 8, [PAD, "strategy=model_parallel", "strategy.pp=2"]),
    "cp": (2, 8, [PAD, "strategy=model_parallel", "strategy.cp=2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """Each layout's run folder and its weights after 3 steps, through parallama-export."""
    tmp = tmp_path_factory.mktemp("vocab_padding")
    out = {}
    for name, (ranks, batch, args) in LAYOUTS.items():
        run = tmp / name
        weights = layout_weights(run, *COMMON, *args, ranks=ranks, batch=batch, cwd=tmp, cache=data_cache)
        out[name] = run, weights
    return out


@pytest.mark.parametrize("layout", ["unpadded", "fsdp", "tp", "pp", "cp"])
def test_the_padded_head_trains_as_each_unpadded_layout(runs, layout):
    expected, actual = runs["padded"][1], runs[layout][1]
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_exports_the_true_vocabulary(runs, layout):
    run, weights = runs[layout]
    assert weights["lm_head.weight"].shape[0] == weights["model.embed_tokens.weight"].shape[0] == 300
    assert json.loads((run / "hf" / "config.json").read_text())["vocab_size"] == 300
