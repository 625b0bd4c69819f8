"""`parallama-train` (or `python -m parallama.train`): check the command line's config, then run the training job
(app/run.py) as a Hydra app (conf/train.yaml), or a sweep's jobs (`-m`, or a preset that asks for one), as
many at once as the devices allow (parallama.sweeps). Returns the final `optimized_metric` to the sweeper (Optuna minimizes it)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from omegaconf import DictConfig

from parallama.app import run_dir
from parallama.app.checks import check_config
from parallama.app.run import train
from parallama.cli import app
from parallama.errors import EXIT_BAD_INPUT, ConfigError, RankDied, TrainingDiverged, exit_status
from parallama.runtime import faults
from parallama.runtime.launch import pin_to_job_cores, use_private_torch_extensions


def train_job(cfg: DictConfig) -> float | None:
    """One job: train, then the value of `optimized_metric` (default val/loss), which sweeps minimize. A start
    refused for bad input found only once the run is under way (its data, a trained tokenizer) removes the run
    directory it made, as a refusal before Hydra made it leaves none (app/run_dir.py `check_run_dir`)."""
    try:
        return _train_job(cfg)
    except Exception as err:
        if exit_status(err)[0] == EXIT_BAD_INPUT:
            _forget_refused_start(Path(cfg.paths.output_dir))
        raise


def _forget_refused_start(output_dir: Path) -> None:
    """Remove `output_dir`, and the folders made for it, if this start made it (the preflight found none) and it
    holds no checkpoint."""
    made_in = run_dir.run_dir_made_in  # read now: the preflight sets it
    if made_in is None or any(output_dir.glob("checkpoints/*")):
        return
    shutil.rmtree(output_dir, ignore_errors=True)
    for parent in output_dir.absolute().parents:
        if parent == made_in.absolute() or any(parent.iterdir()):
            break
        parent.rmdir()


def _train_job(cfg: DictConfig) -> float | None:
    from parallama.training.loggers import finish_wandb_run  # torch-free module

    try:
        metrics, _ = train(cfg)
    except TrainingDiverged as err:
        raise TrainingDiverged(f"{err} ({faults.last_checkpoint_note(cfg.paths.output_dir)})") from None
    except RuntimeError as err:  # gloo's error for a peer rank that is gone: one line naming it
        if (line := faults.lost_rank(err)) is not None:
            raise RankDied(line) from None
        raise
    finally:
        faults.stop_watching()
        finish_wandb_run()
    name = cfg.get("optimized_metric")
    if name and name not in metrics:  # a sweeper cannot score the trial
        raise ConfigError(
            f"optimized_metric={name} was not logged by this run; logged: {', '.join(sorted(metrics))} "
            "(is validation off? trainer.limit_val_batches must be > 0)"
        )
    metric = metrics.get(name or "val/loss")
    return float(metric) if metric is not None else None


def main(argv: list[str] | None = None) -> None:
    pin_to_job_cores()  # first: before torch starts its threads
    app.run("train", train_job, argv, check=check, log_errors=True, setup=setup)


def setup() -> None:
    """Once the config passed."""

    import hydra_plugins.parallama_sweeps as sweeps  # start-up time (the sweeps' modules)

    use_private_torch_extensions()
    sweeps.register()
    # parallama's data module restores the position inside the epoch itself (TextDataModule.state_dict), so
    # Lightning's warning that the loader "is not resumable" does not apply.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")


def check(cfg: DictConfig, hardware: bool) -> None:
    check_config(cfg, hardware=hardware)


if __name__ == "__main__":
    main()
