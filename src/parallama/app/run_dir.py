"""The run directory's refusals, made in the preflight before Hydra creates the directory or writes `.hydra/` and
its log there: whether a live run owns it, whether a finished run's last.ckpt is there without `ckpt_path`,
whether `ckpt_path=last` finds something to resume (checkpoint/resume.py's own checks, which the run makes
again as it claims the directory). Found: a refused second run rewrote the live run's .hydra/config.yaml and
appended its refusal to that run's train.log; `ckpt_path=last` with no run to resume left an empty directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from parallama.checkpoint.resume import check_fresh_run, refuse_live_owner, resolve_ckpt_path
from parallama.runtime.launch import first_process

# Where the run directory `check_run_dir` looked at was to be made (its nearest existing folder; None: it existed):
# a start that then fails for bad input removes what it made (cli/train.py), so a refused start leaves nothing
# behind wherever it is found out.
run_dir_made_in: Path | None = None


def check_run_dir(cfg: DictConfig) -> None:
    """The refusals a run meets in its own directory (`paths.output_dir`). Where Hydra runs one job in a known
    directory (a sweep's jobs check their own as they start), in a job's first process (its other ranks follow
    it, and a multi-node run's owner is on another host)."""
    global run_dir_made_in
    run_dir_made_in = None
    if not HydraConfig.initialized() or HydraConfig.get().mode == RunMode.MULTIRUN or not first_process():
        return
    output_dir = cfg.paths.output_dir
    if not os.path.exists(output_dir):
        run_dir_made_in = next(p for p in Path(output_dir).parents if p.exists())
    refuse_live_owner(output_dir)
    job = OmegaConf.masked_copy(cfg, ["paths", "ckpt_path"])  # check_fresh_run may set ckpt_path (a requeue)
    check_fresh_run(job)
    if job.ckpt_path == "last":
        resolve_ckpt_path("last", output_dir)
