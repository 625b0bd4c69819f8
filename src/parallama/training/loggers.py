"""Loggers that work out of the box: a CSV log that survives resumes and spawned ranks, and W&B online
with an API key, offline (synced later) without one.

Without a W&B key W&B fails at start-up and, under ddp, the other ranks then die on a closed socket; so `mode: auto`
picks offline mode unless a key is configured (WANDB_API_KEY, or `wandb login`'s netrc entry).
Checkpoints store the W&B run id (`WandbRunId`); a run resumed from one continues that W&B run.
"""

from __future__ import annotations

import csv
import logging
import netrc
import os
from urllib.parse import urlparse

import lightning as L
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from omegaconf import DictConfig, open_dict

from parallama.checkpoint.formats import client_state
from parallama.errors import ConfigError

log = logging.getLogger("parallama")
MODES = ("auto", "online", "offline", "disabled")
RUN_ID_KEY = "wandb_run_id"


class _AppendingWriter(ExperimentWriter):
    """Lightning's writer deletes an existing metrics.csv, and when new columns appear it rewrites the file
    with only the columns it logged itself. A resumed run then erased its history, and under ddp_spawn the
    fit's workers (which never saw the validate workers' `val/*` columns) crashed on the rewrite.
    This one keeps the file and starts from its header, so every process appends to one history."""

    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = sorted(set(self.metrics_keys) | set(next(csv.reader(file), [])))

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        self._check_log_dir_exists()  # another process may have added columns since
        super()._rewrite_with_new_header(self.metrics_keys)

    def save(self) -> None:
        if self.metrics and self._fs.isfile(self.metrics_file_path):
            self._check_log_dir_exists()
        super().save()


class AppendingCSVLogger(CSVLogger):
    """`metrics.csv` that a resumed run appends to (rows past the checkpoint's step then appear twice; the
    later row is the resumed run's)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


def wandb_api_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


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
    return WandbLogger(save_dir=save_dir, offline=mode == "offline", mode=mode, **kwargs)


class WandbRunId(L.Callback):
    """Writes the W&B run id into every checkpoint (`checkpoint["wandb_run_id"]`)."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger) and logger.version:
                checkpoint[RUN_ID_KEY] = logger.version


def continue_wandb_run(cfg: DictConfig, ckpt_path: str | None) -> None:
    """Resuming: the W&B logger continues the run its checkpoint names (unless the logger's `id` is set)."""
    for node in (cfg.get("logger") or {}).values():
        if ckpt_path and node and node.get("_target_") == f"{__name__}.wandb_logger" and not node.get("id"):
            run_id = client_state(ckpt_path).get(RUN_ID_KEY)
            if run_id:
                with open_dict(node):
                    node.id = run_id
