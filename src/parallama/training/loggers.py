"""Loggers that work out of the box: a CSV log that survives resumes and spawned ranks, and W&B online
with an API key, offline (synced later) without one.

Without a W&B key W&B fails at start-up and, under ddp, the other ranks then die on a closed socket; so `mode: auto`
picks offline mode unless a key is configured (WANDB_API_KEY, or `wandb login`'s netrc entry).
Checkpoints store the W&B run id (`WandbRunId`); a run resumed from one continues that W&B run. Both halves are
wired here alone (`continue_wandb_run`), not in the config: any W&B logger gets them, parallama's or yours (a
`_target_` naming a WandbLogger subclass, or a function whose return annotation is one).
"""

from __future__ import annotations

import csv
import logging
import os
import signal
import sys
import typing
from argparse import Namespace
from contextlib import suppress

import lightning as L
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, open_dict
from torch import Tensor

from parallama.checkpoint.formats import client_state
from parallama.config.parts import locate
from parallama.errors import ConfigError
from parallama.training.preemption import stop_signal
from parallama.training.wandb_env import wandb_api_key_configured

log = logging.getLogger("parallama")
_told_lost: set[str | None] = set()  # the W&B runs whose lost service was said
MODES = ("auto", "online", "offline", "disabled")
RUN_ID_KEY = "wandb_run_id"


class AppendingCSVLogger(Logger):
    """`<save_dir>/<name>/<version>/metrics.csv` (and `hparams.yaml`) that a resumed run, or another process of the
    same run (ddp_spawn's validate and fit workers), appends to; a new column rewrites the file with the union
    of the columns. Lightning's CSVLogger deletes an existing metrics.csv and keeps only the columns it logged
    itself. Rows past a resumed checkpoint's step appear twice; the later row is the resumed run's. Test:
    tests/unit/test_training_callbacks.py::test_the_csv_history_survives_a_resume_and_new_columns."""

    def __init__(
        self, save_dir: str, name: str = "csv", version: str = "", flush_logs_every_n_steps: int = 100
    ):
        super().__init__()
        self._save_dir, self._name, self._version = save_dir, name, version
        self.flush_logs_every_n_steps = flush_logs_every_n_steps
        self.rows: list[dict] = []
        self.hparams: dict = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> str:
        return self._version

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def log_dir(self) -> str:
        return os.path.join(self._save_dir, self._name, self._version)

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.log_dir, "metrics.csv")

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        self.hparams.update(vars(params) if isinstance(params, Namespace) else dict(params))
        os.makedirs(self.log_dir, exist_ok=True)
        save_hparams_to_yaml(os.path.join(self.log_dir, "hparams.yaml"), self.hparams)

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        row = {k: v.item() if isinstance(v, Tensor) else v for k, v in metrics.items()}
        self.rows.append({**row, "step": len(self.rows) if step is None else step})
        if step is not None and step % self.flush_logs_every_n_steps == 0:
            self.save()

    @rank_zero_only
    def save(self) -> None:
        if not self.rows:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        old_rows, old_keys = [], []
        if os.path.isfile(self.metrics_file):
            with open(self.metrics_file, newline="") as file:
                reader = csv.DictReader(file)
                old_keys, old_rows = list(reader.fieldnames or []), list(reader)
        keys = sorted(set(old_keys).union(*self.rows))
        if keys == old_keys:  # the usual case: append
            with open(self.metrics_file, "a", newline="") as file:
                csv.DictWriter(file, fieldnames=keys).writerows(self.rows)
        else:
            with open(self.metrics_file, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=keys)
                writer.writeheader()
                writer.writerows([*old_rows, *self.rows])
        self.rows = []

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()


def wandb_logger(mode: str = "auto", save_dir: str = ".", **kwargs) -> WandbLogger:
    """A Lightning WandbLogger; `mode` as in `wandb.init`, plus `auto` (WANDB_MODE if set, else by API key)."""
    if mode not in MODES:
        raise ConfigError(f"logger.wandb.mode={mode!r} is not one of {', '.join(MODES)}")
    if mode == "auto":
        mode = os.environ.get("WANDB_MODE") or ("online" if wandb_api_key_configured() else "offline")
        mode = "offline" if mode == "dryrun" else mode  # Lightning itself sets WANDB_MODE=dryrun when offline
        if mode == "offline":
            log.info(
                f"W&B: no API key configured, logging offline; upload later with `wandb sync {save_dir}/wandb/offline-run-*`"
            )
    os.makedirs(save_dir, exist_ok=True)
    return PreemptibleWandbLogger(save_dir=save_dir, offline=mode == "offline", mode=mode, **kwargs)


class PreemptibleWandbLogger(WandbLogger):
    """Lightning's WandbLogger in a run that a stop signal may end. W&B logs through a service process of its own
    (wandb-core), which a signal to the whole job reaches too: SLURM's scancel signals every process of the job
    (proctrack follows the process tree, whatever the session), and wandb-core exits at once. Every later W&B
    call then raises ConnectionResetError, which ended the run before PreemptionCheckpoint saved: no last.ckpt
    (found under the tests' SLURM cluster). After a stop signal, the first call that finds the service gone is one
    warning, W&B is left alone, and the run saves and stops as without W&B; `ckpt_path=last` continues the W&B
    run. What the service had not written is lost to W&B (offline, under the test cluster: all of the cancelled
    job's steps; metrics.csv has them). Without a signal a lost service stays an error. Test:
    tests/slurm/test_srun.py::test_scancel_stops_every_rank_with_a_checkpoint_that_loads."""

    service_lost = False

    def _unless_lost(self, method, *args) -> None:
        if self.service_lost:
            return
        try:
            method(*args)
        except ConnectionError as err:
            if not _lost_to_a_stop_signal(err, self.version):
                raise
            self.service_lost = True

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        self._unless_lost(super().log_hyperparams, params)

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        self._unless_lost(super().log_metrics, metrics, step)

    @rank_zero_only
    def after_save_checkpoint(self, checkpoint_callback) -> None:
        self._unless_lost(super().after_save_checkpoint, checkpoint_callback)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self._unless_lost(super().finalize, status)


def finish_wandb_run() -> None:
    """Close this process's W&B run, if any (one W&B run per sweep job: before the next job starts). Its service
    gone after a stop signal, there is nothing to close: drop the connection, whose exit hook would print a
    traceback."""
    wandb = sys.modules.get("wandb")
    if wandb is None or wandb.run is None:
        return
    try:
        wandb.finish()
    except ConnectionError as err:
        if not _lost_to_a_stop_signal(err, wandb.run.id):
            raise
        with suppress(ConnectionError):
            wandb.teardown()


def _lost_to_a_stop_signal(err: ConnectionError, run_id: str | None) -> bool:
    """W&B's service is gone (`err`): after a stop signal, say so in one line (True); otherwise an error."""
    if not (signum := stop_signal()):
        return False
    if run_id in _told_lost:
        return True
    _told_lost.add(run_id)
    log.warning(
        f"W&B: its service ended with the {signal.Signals(signum).name} ({err}), as SLURM signals every process "
        f"of a job: W&B run {run_id} may lack this run's last steps (metrics.csv has them); saving without W&B; "
        "ckpt_path=last continues the W&B run"
    )
    return True


class WandbRunId(L.Callback):
    """Writes the W&B run id into every checkpoint (`checkpoint["wandb_run_id"]`)."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and logger.version:
                checkpoint[RUN_ID_KEY] = logger.version


def continue_wandb_run(cfg: DictConfig, ckpt_path: str | None) -> list[L.Callback]:
    """W&B run continuation, all of it, called before the loggers are built: a W&B logger continues the run that
    `ckpt_path` names (unless the logger's `id` is set), and the callback returned (`WandbRunId`, none without a
    W&B logger) names this run in every checkpoint it writes."""
    nodes = [
        node for node in (cfg.get("logger") or {}).values() if node and is_wandb_logger(node.get("_target_"))
    ]
    run_id = client_state(ckpt_path).get(RUN_ID_KEY) if nodes and ckpt_path else None
    for node in nodes:
        if run_id and not node.get("id"):
            with open_dict(node):
                node.id = run_id
    return [WandbRunId()] if nodes else []


def is_wandb_logger(target: str | None) -> bool:
    """Whether the `_target_` of a logger names a W&B one: a subclass of Lightning's WandbLogger, or a function
    whose return annotation is one (`wandb_logger`). One that does not import is not (its build says why)."""
    try:
        part = locate(target) if target else None
        if part is not None and not isinstance(part, type):
            part = typing.get_type_hints(part).get("return")
    except Exception:  # ImportError, AttributeError, an annotation that does not resolve (NameError)
        return False
    return isinstance(part, type) and issubclass(part, WandbLogger)
