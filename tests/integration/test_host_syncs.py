"""Host reads of device values per optimizer step, with the default callbacks, and metrics.csv's step numbers.

On a GPU every read of a value the step computed (`.item()`, `if tensor`, `float(tensor)`, a Python number turned
into a device tensor, an all_reduce read back, a clock after `synchronize`) stops the host from running ahead of
the GPU. A CPU has no queue, so this counts the calls that would be such reads in a real `parallama-train` run on
CPU, once as on a CPU and once with `syncs.device_waits` answering as on a GPU: there, the steps whose metrics
Lightning does not write (log_every_n_steps=5 here) make none. The optimizer's own `.item()` on its step counters
is not counted: they are host tensors (and on GPUs fused AdamW makes none).
"""

from __future__ import annotations

import collections
import csv
import traceback
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.optim  # noqa: F401 - TorchScript-compiles on import: before torch.tensor is wrapped
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from torchmetrics import MaxMetric

from parallama import CONF_DIR
from parallama.app import run
from parallama.training import syncs
from parallama.training.module import CausalLM
from parallama.training.schedules import WarmupCosine

STEPS, EVERY, BATCH, SEQ = 12, 5, 4, 64
LOGGED = {5, 10, 12}  # every 5 steps and the run's last


class WithMaxLoss(CausalLM):
    """docs/customize.md's training metric, train/max_loss: updated every step, read on logging steps only."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.train_metrics["max_loss"] = MaxMetric(nan_strategy="disable")

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.train_metrics["max_loss"].update(loss.detach())
        return loss


def reads_per_step(monkeypatch, tmp_path: Path, cache: Path, gpu: bool) -> tuple[dict, Path]:
    """{optimizer step: [what read the device, ...]} for one tiny run, and its run directory."""
    if gpu:
        monkeypatch.setattr(syncs, "device_waits", lambda trainer: True)
    reads, step = collections.defaultdict(list), [None]

    def counted(owner, name, when=lambda *a, **k: True):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if step[0] is not None and when(*args, **kwargs):
                caller = traceback.extract_stack(limit=2)[0]
                if "/torch/optim/" not in caller.filename:
                    reads[step[0]].append(f"{name} in {Path(caller.filename).name}:{caller.lineno}")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        counted(torch.Tensor, name)
    counted(torch, "tensor", when=lambda *a, device=None, **k: device is not None)  # a number to the device
    counted(torch.distributed, "all_reduce")
    counted(syncs, "wait_for_device")

    class Steps(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            step[0] = trainer.global_step + 1

        def on_train_end(self, trainer, *args):
            step[0] = None

    instantiate = run.instantiate_dict
    monkeypatch.setattr(
        run,
        "instantiate_dict",
        lambda node: instantiate(node) + ([Steps()] if node and "throughput" in node else []),
    )
    run_dir = tmp_path / ("gpu" if gpu else "cpu")
    overrides = [
        "trainer.accelerator=cpu",
        f"trainer.max_steps={STEPS}",
        f"trainer.log_every_n_steps={EVERY}",
        "trainer.val_check_interval=1000",
        "trainer.limit_val_batches=2",
        f"data.batch_size={BATCH}",
        f"data.seq_len={SEQ}",
        "data.source.max_documents=12",
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "model.num_hidden_layers=2",
        "sample.max_new_tokens=0",
        "callbacks.throughput.window_size=5",
        f"module._target_={__name__}.WithMaxLoss",
        f"paths.cache_dir={cache}",
        f"paths.output_dir={run_dir}",
        f"hydra.run.dir={run_dir}",
    ]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train.yaml", return_hydra_config=True, overrides=overrides)
        HydraConfig().set_config(cfg)
        run.train(cfg)
    GlobalHydra.instance().clear()
    return reads, run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("syncs")
    with pytest.MonkeyPatch.context() as monkeypatch:
        cpu = reads_per_step(monkeypatch, tmp, data_cache, gpu=False)
    with pytest.MonkeyPatch.context() as monkeypatch:
        gpu = reads_per_step(monkeypatch, tmp, data_cache, gpu=True)
    return {"cpu": cpu, "gpu": gpu}


def test_on_a_gpu_only_the_logging_steps_read_the_device(runs):
    reads, _ = runs["gpu"]
    assert {s: r for s, r in reads.items() if s not in LOGGED} == {}
    for s in LOGGED:  # the counter sees reads: the loss check, the clock, the logged row
        assert any("wait_for_device" in r for r in reads[s]), reads[s]
        assert any("__bool__ in module.py" in r for r in reads[s]), reads[s]


def test_on_a_cpu_every_step_reads_as_before(runs):
    reads, _ = runs["cpu"]
    for s in range(1, STEPS + 1):  # the loss is checked for NaN and the clock read after every step
        assert any("__bool__ in module.py" in r for r in reads[s]), (s, reads[s])
        assert any("wait_for_device" in r for r in reads[s]), (s, reads[s])


def rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
def test_every_metrics_csv_row_is_numbered_after_n_steps(runs, mode):
    """Loss, tokens seen, learning rate and tokens/s rows of step N are logged after N optimizer steps (as the
    console's `step N` and `stepNNNNNNN.ckpt`); the learning rate is the one step N used."""
    _, run_dir = runs[mode]
    table = rows(run_dir)
    for key in (
        "train/loss",
        "train/tokens_seen",
        "lr-AdamW/pg1",
        "train/batches",
        "val/loss",
        "train/max_loss",
    ):
        steps = {int(r["step"]) for r in table if r.get(key)}
        assert steps == ({0, STEPS} if key == "val/loss" else LOGGED), (key, steps)  # val: before and after
    for r in table:
        if r.get("train/tokens_seen"):
            assert float(r["train/tokens_seen"]) == int(r["step"]) * BATCH * SEQ
        if r.get("train/lengths"):  # tokens the throughput monitor counted
            assert float(r["train/lengths"]) == int(r["step"]) * BATCH * SEQ
        if r.get("train/max_loss"):  # the highest loss of the steps since the last row, this row's among them
            assert float(r["train/max_loss"]) >= float(r["train/loss"])
    schedule = WarmupCosine().lr_lambda(STEPS)  # conf/scheduler/warmup_cosine.yaml's, at optimizer.lr 3e-3
    for r in table:  # the rate step N used (the schedule's after N - 1 steps), beside step N's loss
        if r.get("lr-AdamW/pg1"):
            assert float(r["lr-AdamW/pg1"]) == pytest.approx(3e-3 * schedule(int(r["step"]) - 1), rel=1e-6)
    assert any(r.get("train/device/items_per_sec") for r in table)  # the window (5 batches) filled
