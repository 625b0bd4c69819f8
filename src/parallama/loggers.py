"""W&B that works out of the box: online with an API key, offline (synced later) without one.

Without a key W&B fails at start-up and, under ddp, the other ranks then die on a closed socket; so `mode: auto`
picks offline mode unless a key is configured (WANDB_API_KEY, or `wandb login`'s netrc entry).
Checkpoints store the W&B run id (`WandbRunId`); a run resumed from one continues that W&B run.
"""

from __future__ import annotations

import logging
import netrc
import os
from urllib.parse import urlparse

import lightning as L
from lightning.pytorch.loggers import WandbLogger
from omegaconf import DictConfig, open_dict

from parallama.checkpoint import read_client_state
from parallama.errors import ConfigError

log = logging.getLogger("parallama")
MODES = ("auto", "online", "offline", "disabled")
RUN_ID_KEY = "wandb_run_id"


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
            run_id = read_client_state(ckpt_path).get(RUN_ID_KEY)
            if run_id:
                with open_dict(node):
                    node.id = run_id
