"""parallama's own callback and logger on Lightning's public API: last.ckpt's schedule, a CSV history that a
resumed run (or another process of the run) appends to, and which loggers continue a W&B run."""

import csv
import os
import sys
from datetime import timedelta

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from parallama.training.callbacks import LastCheckpoint
from parallama.training.loggers import AppendingCSVLogger, WandbRunId, continue_wandb_run


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).square().mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 2), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def saved_steps(tmp_path, max_steps=7, **kwargs) -> list[int]:
    callback = LastCheckpoint(str(tmp_path), **kwargs.pop("callback", {}))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **kwargs,
    )
    saves = []
    trainer.save_checkpoint = lambda path, *args, **kw: saves.append((path, trainer.global_step))
    trainer.fit(Tiny())
    assert all(path == str(tmp_path / "last.ckpt") for path, _ in saves)
    return [step for _, step in saves]


@pytest.mark.parametrize(
    "callback, kwargs, steps",
    [
        ({"every_n_train_steps": 3}, {}, [3, 6, 7]),  # and always the run's last step
        ({"every_n_train_steps": 3}, {"accumulate_grad_batches": 2}, [3, 6, 7]),  # optimizer steps, once each
        ({"train_time_interval": timedelta(0)}, {}, [1, 2, 3, 4, 5, 6, 7]),
        ({"every_n_train_steps": 5, "train_time_interval": timedelta(hours=1)}, {}, [5, 7]),  # N and/or T
        ({}, {}, [7]),
        ({"every_n_train_steps": 1}, {"fast_dev_run": 2}, []),  # a smoke test writes nothing
    ],
)
def test_last_checkpoint_is_written_every_n_steps_and_or_every_t_and_at_the_end(
    tmp_path, callback, kwargs, steps
):
    assert saved_steps(tmp_path, callback=callback, **kwargs) == steps


def test_the_csv_history_survives_a_resume_and_new_columns(tmp_path):
    first = AppendingCSVLogger(str(tmp_path), version="")
    first.log_hyperparams({"lr": 0.1})
    first.log_metrics({"train/loss": torch.tensor(2.0)}, step=0)
    first.log_metrics({"train/loss": 1.5}, step=1)
    first.finalize("success")
    resumed = AppendingCSVLogger(str(tmp_path), version="")  # a new process, same run directory
    resumed.log_metrics({"train/loss": 1.2, "val/loss": 1.4}, step=2)
    resumed.finalize("success")
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "train/loss", "val/loss"]
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in rows] == [
        ("0", "2.0", ""),
        ("1", "1.5", ""),
        ("2", "1.2", "1.4"),
    ]
    assert "lr: 0.1" in (tmp_path / "csv" / "hparams.yaml").read_text()


def test_a_single_device_run_gets_the_slurm_environment_its_strategy_lacks(monkeypatch, tmp_path):
    """A single device's strategy holds no cluster environment: the preemption callback takes the configured
    SLURMEnvironment (launcher=slurm's), or Lightning's default inside a SLURM batch job, or none outside SLURM."""
    import signal

    from lightning.fabric.plugins.environments import SLURMEnvironment

    from parallama.training.preemption import PreemptionCheckpoint, requeue_single_device_jobs

    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    preemption = PreemptionCheckpoint(str(tmp_path))
    requeue_single_device_jobs([preemption], [])
    assert preemption.slurm_environment is None  # not under SLURM

    configured = SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR2)
    requeue_single_device_jobs([preemption], [configured])
    assert preemption.slurm_environment is configured

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train.sbatch")
    requeue_single_device_jobs([preemption], [])
    assert isinstance(preemption.slurm_environment, SLURMEnvironment)
    assert preemption.slurm_environment.requeue_signal == signal.SIGUSR1


class Logged(Tiny):
    """Tiny with a logged loss and a validation that counts its batches."""

    validated = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        Logged.validated += 1

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)


class SignalAt(L.Callback):
    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_a_stop_keeps_the_stop_steps_row_and_validates_nothing(tmp_path, signame):
    """Found: each SIGTERM stop lost its step's `train/loss` row (the step trained and saved): Lightning hands a
    step's metrics to the loggers after `on_train_batch_end`, where the stop was raised. Rows come every 2 steps
    here; the stop at step 3, where a validation is due, logs its row and validates nothing."""
    import signal

    from parallama.errors import Preempted
    from parallama.training.preemption import PreemptionCheckpoint

    logger = AppendingCSVLogger(str(tmp_path), version="")
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=10,
        val_check_interval=3,
        num_sanity_val_steps=0,
        log_every_n_steps=2,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            SignalAt(3, getattr(signal, signame)),
            PreemptionCheckpoint(str(tmp_path / "checkpoints")),
        ],
    )
    Logged.validated = 0
    with pytest.raises(Preempted, match=f"stopped by {signame} at step 3"):
        trainer.fit(Logged())
    with open(logger.metrics_file) as f:
        rows = [row for row in csv.DictReader(f) if row["train/loss"]]
    assert [int(row["step"]) for row in rows] == [1, 2]  # Lightning numbers a row by the steps before it
    assert Logged.validated == 0
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_the_default_bounds_the_work_a_kill_loses_by_steps_and_by_time():
    """README, "Long runs": a kill -9 loses at most 100 steps or 30 minutes with the defaults."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from parallama import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train")
    node = cfg.callbacks.last_checkpoint
    assert (node.every_n_train_steps, instantiate(node.train_time_interval)) == (100, timedelta(minutes=30))


YOUR_LOGGERS = """
from lightning.pytorch.loggers import CSVLogger, WandbLogger


class MyWandb(WandbLogger):
    pass


def my_wandb(project: str = "x") -> MyWandb:
    return MyWandb(project=project)


def my_csv() -> CSVLogger:
    return CSVLogger(".")
"""


def test_a_wandb_logger_of_yours_continues_the_run(tmp_path, monkeypatch):
    """A W&B logger is asked of its part (a WandbLogger subclass, or a function returning one), not matched by
    its `_target_`: yours continues the checkpoint's W&B run as the shipped one does; other loggers do not."""
    (tmp_path / "your_loggers.py").write_text(YOUR_LOGGERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "your_loggers", raising=False)
    torch.save({"wandb_run_id": "abc", "state_dict": {}}, tmp_path / "last.ckpt")
    loggers = {
        "subclass": "your_loggers.MyWandb",
        "factory": "your_loggers.my_wandb",
        "shipped": "parallama.training.loggers.wandb_logger",
        "csv": "parallama.training.loggers.AppendingCSVLogger",
        "csv_factory": "your_loggers.my_csv",
        "lightning_csv": "lightning.pytorch.loggers.CSVLogger",
    }
    cfg = OmegaConf.create({"logger": {name: {"_target_": target} for name, target in loggers.items()}})
    cfg.logger.pinned = {"_target_": "your_loggers.MyWandb", "id": "kept"}  # its own id wins
    callbacks = continue_wandb_run(cfg, str(tmp_path / "last.ckpt"))
    assert [type(c) for c in callbacks] == [WandbRunId]
    assert {name: node.get("id") for name, node in cfg.logger.items()} == {
        **dict.fromkeys(("subclass", "factory", "shipped"), "abc"),
        **dict.fromkeys(("csv", "csv_factory", "lightning_csv"), None),
        "pinned": "kept",
    }
    csv_only = OmegaConf.create({"logger": {"csv": {"_target_": loggers["csv"]}}})
    assert continue_wandb_run(csv_only, str(tmp_path / "last.ckpt")) == []
