"""How ranks are started.

Lightning's `ddp` starts ranks > 0 by re-running `sys.argv`. Under a Hydra sweep (`-m a=1,2`) that re-runs the
whole sweep in every child, and under the Optuna sweeper every child runs its own study with other
hyper-parameters. `patch_ddp_relaunch` makes each child run exactly its parent's job instead: the job's own
overrides, in the job's own directory, never in multirun mode. `JobIsolation` (a Hydra callback, see
conf/hydra/default.yaml) closes each job's process group and environment so that the next job of a sweep starts
its own ranks instead of joining the finished job's.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from hydra.experimental.callback import Callback


def ddp_child_command(local_rank: int) -> tuple[list[str], str]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd

    hc = HydraConfig.get()
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)  # `python -m <module>`; else a script or a console script
    command = (
        [sys.executable, "-m", spec.name]
        if spec is not None
        else [sys.executable, os.path.abspath(sys.argv[0])]
    )
    for source in hc.runtime.config_sources:
        if source.provider == "command-line":  # a --config-dir the user gave
            command += ["--config-dir", source.path]
    command += ["--config-name", hc.job.config_name, *hc.overrides.task]
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        f"hydra.job.name=train_ddp_process_{local_rank}",
        "hydra.output_subdir=null",
        "hydra.mode=RUN",  # a search preset may set MULTIRUN
    ]
    return command, get_original_cwd()


def patch_ddp_relaunch() -> None:
    from parallama.runtime.compat import replace_hydra_subprocess_cmd

    replace_hydra_subprocess_cmd(ddp_child_command)


# Set in os.environ by Lightning's launchers (and WANDB_MODE by its offline WandbLogger) for the job under way.
JOB_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "WANDB_MODE")


class JobIsolation(Callback):
    """Each job of a sweep starts as the first did: no process group open, no rank variables left behind.

    Otherwise the next job joins the finished job's (gone) process group, and with LOCAL_RANK set Lightning
    would not start its ranks at all.
    """

    def on_job_start(self, config, **kwargs) -> None:
        self.environ = {key: os.environ.get(key) for key in JOB_ENV}
        if config.hydra.job.get("num", 0) and "MASTER_PORT" in os.environ and not _launched_externally():
            # A port the user fixed (MASTER_PORT=...) would be every job's: the finished job's store can still
            # listen there (a reference cycle keeps it alive) and hand the next job its ranks' stale addresses.
            # Ranks this process starts need only agree with it, so each later job gets a free port.
            os.environ["MASTER_PORT"] = str(_free_port())

    def on_job_end(self, config, job_return, **kwargs) -> None:
        import torch.distributed as dist

        from parallama.runtime.compat import destroy_deepspeed_groups

        if dist.is_available() and dist.is_initialized() and not destroy_deepspeed_groups():
            dist.destroy_process_group()
        for key, value in self.environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _launched_externally() -> bool:
    """torchrun, SLURM or another launcher started this process: its port is shared with other nodes."""
    return any(key in os.environ for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "LSB_JOBID", "NODE_RANK"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_private_torch_extensions() -> None:
    """DeepSpeed JIT-builds C++ ops into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions, shared by
    every environment). Two environments then rebuild each other's ops, and a build killed midway leaves a lock
    on which every later run waits forever. So: one directory per Python environment, and a lock older than any
    build is removed (with a warning) instead of waited on. Ranks started later inherit the variable."""
    import hashlib
    import logging
    import time

    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        env = hashlib.sha256(sys.prefix.encode()).hexdigest()[:10]
        tag = f"py{sys.version_info.major}{sys.version_info.minor}-{env}"
        os.environ["TORCH_EXTENSIONS_DIR"] = str(
            Path.home() / ".cache" / "parallama" / "torch_extensions" / tag
        )
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    for lock in root.glob("*/lock"):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # the build finished meanwhile
            continue
        if age > STALE_BUILD_LOCK_S:
            lock.unlink(missing_ok=True)
            logging.getLogger("parallama").warning(
                f"removed {lock}: a C++ extension build lock {age / 60:.0f} min old, left by a killed build"
            )


STALE_BUILD_LOCK_S = 20 * 60  # a DeepSpeed op builds in about a minute on 2 cores
