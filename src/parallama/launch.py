"""How ranks are started and where a resumed run's checkpoint is found.

Lightning's `ddp` starts ranks > 0 by re-running `sys.argv`. Under a Hydra sweep (`-m a=1,2`) that re-runs the
whole sweep in every child, and under the Optuna sweeper every child runs its own study with other
hyper-parameters. `patch_ddp_relaunch` makes each child run exactly its parent's job instead: the job's own
overrides, in the job's own directory, never in multirun mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

from parallama.errors import ConfigError


def ddp_child_command(local_rank: int) -> tuple[list[str], str]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    hc = HydraConfig.get()
    command = [sys.executable, "-m", "parallama.train"]
    for source in hc.runtime.config_sources:
        if source.provider == "command-line":  # a --config-dir the user gave
            command += ["--config-dir", source.path]
    command += ["--config-name", hc.job.config_name, *hc.overrides.task]
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        f"hydra.job.name=train_ddp_process_{local_rank}",
        "hydra.output_subdir=null",
    ]
    return command, get_original_cwd()


def patch_ddp_relaunch() -> None:
    # The pytorch launcher imports the function by name, so both modules need the replacement.
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as pytorch_launcher

    fabric_launcher._hydra_subprocess_cmd = ddp_child_command
    pytorch_launcher._hydra_subprocess_cmd = ddp_child_command


def resolve_ckpt_path(ckpt_path: str | None, output_dir: str, runs_root: str) -> str | None:
    """`last`: this run's last checkpoint, else the newest `last` checkpoint of any earlier run under runs_root."""
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        if not Path(ckpt_path).exists():
            raise ConfigError(f"ckpt_path={ckpt_path} does not exist (give a checkpoint file/folder, or `last`)")
        return str(Path(ckpt_path).resolve())
    own = Path(output_dir) / "checkpoints" / "last.ckpt"
    if own.exists():
        return str(own)
    candidates = sorted(Path(runs_root).glob("**/checkpoints/last*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise ConfigError(f"ckpt_path=last but no checkpoints/last*.ckpt exists under {runs_root}")
    return str(candidates[-1])
