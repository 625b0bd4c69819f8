"""Weighted data mixtures through the CLI: a resumed mixture continues its data order, and another mixture's
checkpoint is refused (the mixture itself: tests/unit/test_mixture.py)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import TINY, run_cli

from parallama.data import TextDataModule, embedded
from parallama.data.datasets import epoch_order
from parallama.data.position import GENESIS, fold
from parallama.tokenizer import byte_level

CONSTANT_LR = ["scheduler.warmup_steps=0", "scheduler.min_lr_ratio=1"]  # a run's schedule ignores its length

MIXTURE = [  # experiment=mixture (prose 0.7, code 0.3) on a few documents, with TINY's model and run
    *(arg for arg in TINY if not arg.startswith("data.source.")),  # a mixture has no data.source
    "experiment=mixture",
    "data.sources.prose.source.max_documents=12",
    "data.sources.code.source.max_documents=6",
    "validate_before_training=false",
    *CONSTANT_LR,
]


def _train(tmp_path, cache, run: str, *args: str, check: bool = True):
    where = [f"paths.cache_dir={cache}", f"hydra.run.dir={tmp_path / run}"]
    return run_cli("parallama.cli.train", *MIXTURE, *where, *args, cwd=tmp_path, check=check)


def _ckpt(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_the_mixture_experiment_resumes_on_the_data_order(tmp_path, data_cache):
    """2 steps, then resumed (ckpt_path=last) to 4: the checkpoint's hash is that of the first 4 global batches of
    the epoch's order, which the data module computes in-process from the same config."""
    _train(tmp_path, data_cache, "run", "trainer.max_steps=2")
    _train(tmp_path, data_cache, "run", "trainer.max_steps=4", "ckpt_path=last")
    data = _ckpt(tmp_path / "run" / "checkpoints" / "last.ckpt")["TextDataModule"]
    corpora = {"prose": ("prose", 12, 0.7), "code": ("code", 6, 0.3)}
    sources = {
        name: {"weight": w, "source": partial(embedded, corpus=corpus, max_documents=n)}
        for name, (corpus, n, w) in corpora.items()
    }
    dm = TextDataModule(tokenizer=byte_level, sources=sources, seq_len=64, cache_dir=str(data_cache))
    dm.setup()
    order, expected = epoch_order(len(dm.datasets["train"]), 42, 0), GENESIS
    for step in range(4):
        expected = fold(expected, order[4 * step : 4 * step + 4])
    assert (data["trained_samples"], data["trained_hash"]) == (16, expected)
    assert (
        data["data.sources"] == {"code": 0.3, "prose": 0.7}
        and data["token cache"] == dm._order()["token cache"]
    )


@pytest.mark.slow  # four more runs (~65 s on 2 cores)
def test_a_resumed_mixture_equals_a_straight_run_and_a_new_weight_is_refused_on_the_cli(tmp_path, data_cache):
    _train(tmp_path, data_cache, "straight", "trainer.max_steps=4")
    _train(tmp_path, data_cache, "resumed", "trainer.max_steps=2")
    _train(tmp_path, data_cache, "resumed", "trainer.max_steps=4", "ckpt_path=last")
    straight = _ckpt(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    resumed = _ckpt(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert straight["state_dict"].keys() == resumed["state_dict"].keys()
    for name, tensor in straight["state_dict"].items():
        assert torch.equal(resumed["state_dict"][name], tensor), name
    assert straight["TextDataModule"]["trained_hash"] == resumed["TextDataModule"]["trained_hash"]

    args = ("trainer.max_steps=6", "ckpt_path=last", "data.sources.code.weight=0.4")
    proc = _train(tmp_path, data_cache, "resumed", *args, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    expected = (
        "was trained with data.sources={'code': 0.3, 'prose': 0.7} but this run has {'code': 0.4, 'prose': 0.7}: "
        "resuming would skip or repeat training samples; resume with the checkpoint's data.sources"
    )
    assert expected in out and "Traceback" not in out
    assert len([line for line in out.splitlines() if "error:" in line]) == 1
