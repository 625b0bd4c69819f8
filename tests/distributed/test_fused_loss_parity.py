"""`loss.impl=fused` under every parallel layout ends with one process's plain-loss weights after 3 steps (1e-5),
each run's log showing which path every rank took:

- parallama's fused linear cross-entropy (its gradients computed in the forward pass) under ddp and fsdp (under
  FSDP2 the head runs as a registered forward method, its weight gathered), tensor parallel with and without
  sequence parallel (vocab-parallel: each rank's rows of the head, the log-sum-exp reduced over the tp ranks), the
  pipeline's last stage and context parallel, these with label smoothing and z-loss; and the zero-bubble pipeline
  schedule zbv (2 stages per rank, so 4 layers in every run here), whose backward runs through the loss twice
  (input gradients, then weight gradients);
- the checkpointed chunks under DeepSpeed's ZeRO-3, through the head module, whose hooks gather its partitioned
  weight.

A loss chunk is 100 tokens, which divides no rank's tokens. One validation batch after the last step runs the plain
path (the pipeline's last stage: its head on the hidden states): its val/loss is one process's too. Vocab-parallel
with a padded vocabulary (`valid_vocab`) and uneven shards, on its own: `test_vocab_parallel_...`.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import layout_weights
from test_recipe import COMMON, LAYOUTS

from parallama.training.loss import FUSED_PATHS

pytestmark = pytest.mark.multiprocess

SMOOTH = ["loss.z_loss=1e-4", "loss.label_smoothing=0.1"]
FUSED = ["loss.impl=fused", "loss.chunk_size=100"]
BASE = ["trainer.limit_val_batches=1", "model.num_hidden_layers=4"]  # a validation batch; 4 layers for zbv
LAYOUTS = {
    **LAYOUTS,
    "tp_sp": (2, 8, [*LAYOUTS["tp"][2], "strategy.sequence_parallel=true"]),
    "zero3": (2, 4, ["strategy=deepspeed", "strategy.stage=3"]),
    "pp_zbv": (2, 8, [*LAYOUTS["pp"][2], "strategy.pp_schedule=zbv"]),
}
RUNS = {  # name: (layout, overrides, the plain one-process run it must equal, the fused path it takes)
    "plain": ("auto", [], None, None),
    "plain_smooth": ("auto", SMOOTH, None, None),
    "ddp": ("ddp", FUSED, "plain", "parallama"),
    "fsdp": ("fsdp", FUSED, "plain", "parallama"),
    "zero3": ("zero3", FUSED, "plain", "checkpointed"),
    "tp": ("tp", FUSED, "plain", "parallama"),
    "tp_sp": ("tp_sp", [*FUSED, *SMOOTH], "plain_smooth", "parallama"),
    "pp": ("pp", [*FUSED, *SMOOTH], "plain_smooth", "parallama"),
    "cp": ("cp", [*FUSED, *SMOOTH], "plain_smooth", "parallama"),
    "pp_zbv": ("pp_zbv", FUSED, "plain", "parallama"),
}


def paths_logged(run: Path) -> list[set[str]]:
    """Each rank's fused paths, from its log file (train.log, train_ddp_process_1.log)."""
    logs = sorted(run.glob("*.log"))
    return [{path for path, line in FUSED_PATHS.items() if line in log.read_text()} for log in logs]


def final_val_loss(run: Path) -> float:
    with open(run / "csv" / "metrics.csv") as f:
        return float([r["val/loss"] for r in csv.DictReader(f) if r.get("val/loss")][-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache) -> dict:
    """Each run's weights after 3 steps, its final val/loss and the fused paths each rank logged."""
    tmp = tmp_path_factory.mktemp("fused_loss")
    out = {}
    for name, (layout, overrides, _, _) in RUNS.items():
        ranks, batch, args = LAYOUTS[layout]
        run = tmp / name
        weights = layout_weights(
            run, *COMMON, *BASE, *overrides, *args, ranks=ranks, batch=batch, cwd=tmp, cache=data_cache
        )
        out[name] = weights, final_val_loss(run), paths_logged(run)
    return out


CASES = [name for name, (_, _, reference, _) in RUNS.items() if reference]


@pytest.mark.parametrize("name", CASES)
def test_the_fused_loss_trains_each_layout_as_one_process_with_the_plain_loss(name, runs):
    (actual, val_loss, paths), (expected, expected_val_loss, _) = runs[name], runs[RUNS[name][2]]
    layout, ranks = RUNS[name][0], LAYOUTS[RUNS[name][0]][0]
    holders = 1 if layout.startswith("pp") else ranks  # a pipeline's head is on its last stage's rank alone
    assert sorted(paths, key=len) == [set()] * (ranks - holders) + [{RUNS[name][3]}] * holders
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-5, msg=key)
    assert val_loss == pytest.approx(expected_val_loss, abs=1e-5)


def test_smoothing_and_z_loss_changed_the_training(runs):
    """Else the smoothed runs' parity would say nothing about the fused path's smoothing and z-loss."""
    plain, smooth = runs["plain"][0], runs["plain_smooth"][0]
    assert max((plain[k] - smooth[k]).abs().max().item() for k in plain) > 1e-4
    assert runs["plain"][2] == [set()]  # the plain loss logs no fused path


def _vocab_parallel_rank(rank: int, world: int, init: str) -> None:
    """Vocab-parallel fused loss (both hidden-state layouts) against the plain loss on the whole head, in each rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from parallama.training.loss import CrossEntropy, fused_path

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    vocab, valid = 301, 290  # shards of 151 and 150 rows; the last 11 rows are padding
    hidden, weight = torch.randn(2, 6, 16), 0.3 * torch.randn(vocab, 16)
    labels = torch.randint(0, valid, (2, 6))
    labels[0, :2] = -100
    loss_fn = CrossEntropy(0.1, 1e-2)
    full = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    expected_loss = loss_fn((full[0] @ full[1][:valid].T), labels)
    expected = torch.autograd.grad(expected_loss, full)
    head = torch.nn.Linear(16, vocab, bias=False)
    head.weight = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    fused = CrossEntropy(0.1, 1e-2, impl="fused", chunk_size=5)
    assert fused_path(fused, head) == "parallama"
    # tensor parallel's hidden states: replicated, or under sequence parallel a DTensor split on the sequence
    for local in (hidden.clone(), distribute_tensor(hidden, mesh, [Shard(1)])):
        local.requires_grad_()
        loss = fused.fused(local, head, labels, valid_vocab=valid)
        got = torch.autograd.grad(loss, [local, head.weight])
        got = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in got]
        torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
        assert got[1][valid:].abs().max() == 0
    dist.destroy_process_group()


def test_vocab_parallel_with_a_padded_vocabulary_and_uneven_shards_equals_the_plain_loss(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_vocab_parallel_rank, args=(2, f"file://{tmp_path}/pg"), nprocs=2)
