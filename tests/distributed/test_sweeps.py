"""Multirun with every multi-process strategy, Optuna under ddp, and the launcher/experiment/debug presets."""

from __future__ import annotations

import csv
import re
import socket

import pytest
import yaml
from conftest import TINY, run_cli, train
from hydra import compose, initialize_config_dir
from wandb_files import wandb_run

from parallama import CONF_DIR
from parallama.checkpoint.formats import client_state

pytestmark = pytest.mark.usefixtures("no_wandb_account")  # W&B picks offline mode by itself


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_dirs(cwd) -> list:
    """The job directories of the one sweep under cwd/logs (asserting nothing else was created)."""
    (sweep,) = (cwd / "logs" / "train" / "multiruns").iterdir()
    assert [p.name for p in (cwd / "logs" / "train").iterdir()] == ["multiruns"]  # no runs/ of stray children
    return sorted(p for p in sweep.iterdir() if p.is_dir())


def rank_lrs(job) -> dict[int, float]:
    """The peak lr each rank built its optimizer with, from the `[rank r/w, ...] ..., lr X` log lines."""
    text = "".join(log.read_text() for log in job.glob("*.log"))
    return {int(r): float(lr) for r, lr in re.findall(r"\[rank (\d+)/\d+.*, lr (\S+)", text)}


def peak_logged_lr(job) -> float:
    with open(job / "csv" / "metrics.csv") as f:
        return max(float(row["lr-AdamW/pg1"]) for row in csv.DictReader(f) if row["lr-AdamW/pg1"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "deepspeed"])
def test_multirun_gives_each_job_its_own_directory(tmp_path, data_cache, strategy):
    """The three ways ranks start and end a job: re-run children (ddp; ddp_sharded and fsdp start theirs the
    same way), spawned children (ddp_spawn), and DeepSpeed's own cached process groups released between jobs.
    Under ddp MASTER_PORT is fixed (as docs/strategies.md suggests for two runs on one node): the second job
    must not rendezvous with the first job's finished ranks."""
    lrs = [1e-3, 2e-3]
    args = [f"strategy={strategy}", "trainer.devices=2", "optimizer.lr=1e-3,2e-3", "logger=[csv,wandb]"]
    args += [
        "validate_before_training=false"
    ]  # one spawn per ddp_spawn job (validate + fit: test_strategies)
    env = {"MASTER_PORT": str(free_port())} if strategy == "ddp" else {}
    run_cli("parallama.cli.train", "-m", *TINY, f"paths.cache_dir={data_cache}", *args, cwd=tmp_path, env=env)
    jobs = job_dirs(tmp_path)
    assert [job.name for job in jobs] == ["0", "1"]
    for job, lr in zip(jobs, lrs):
        assert yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"] == lr
        assert peak_logged_lr(job) == pytest.approx(lr)
        run = wandb_run(job)  # exactly one offline run: rank 0's
        assert run["config"]["config"]["optimizer"]["lr"] == lr
        assert client_state(job / "checkpoints" / "last.ckpt").get("wandb_run_id") == run["id"]
        if strategy != "ddp_spawn":  # re-launched ranks log into the job's directory
            assert rank_lrs(job) == {0: lr, 1: lr}


@pytest.mark.multiprocess
def test_optuna_trials_run_every_rank_with_the_trials_lr_and_short_trials_are_scored(tmp_path, data_cache):
    """Each trial validates after its last step, so a sweep of trials shorter than a validation interval gets a
    (final) score for each."""
    args = ["hparams_search=lr_optuna", "hydra.sweeper.n_trials=2", "strategy=ddp", "trainer.devices=2"]
    train(*args, "trainer.val_check_interval=100", cwd=tmp_path, cache=data_cache)
    jobs = job_dirs(tmp_path)
    assert [job.name for job in jobs] == ["0", "1"]
    trial_lrs = [
        yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"] for job in jobs
    ]
    assert trial_lrs[0] != trial_lrs[1] and all(1e-4 <= lr <= 3e-2 for lr in trial_lrs)
    for job, lr in zip(jobs, trial_lrs):
        assert rank_lrs(job) == pytest.approx({0: lr, 1: lr}, rel=1e-5)  # logged as %g: 6 digits
        assert peak_logged_lr(job) == pytest.approx(lr)
        with open(job / "csv" / "metrics.csv") as f:  # validated after the 4th step (index 3) only
            assert [int(r["step"]) for r in csv.DictReader(f) if r["val/loss"]] == [0, 3]
    results = yaml.safe_load((jobs[0].parent / "optimization_results.yaml").read_text())
    assert results["best_params"]["optimizer.lr"] in trial_lrs and results["best_value"] > 0


@pytest.mark.parametrize(
    "overrides",
    [
        ["launcher=slurm", "trainer.num_nodes=2", "trainer.devices=8"],
        ["experiment=article_180m"],
        ["experiment=lr_width_sweep", "width=w192"],
        ["experiment=mixture"],
        ["hparams_search=lr_optuna"],
        ["debug=fdr"],
        ["debug=limit"],
        ["debug=overfit"],
        ["debug=profiler"],
        ["logger=many"],
        ["logger=[csv,wandb]"],
        ["logger=tensorboard"],
    ],
)
def test_presets_compose(overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    if "launcher=slurm" in overrides:
        assert cfg.hydra.launcher.nodes == 2 and cfg.hydra.launcher.tasks_per_node == 8
    if "width=w192" in overrides:
        assert (cfg.model.hidden_size, cfg.model.intermediate_size) == (192, 576)
    if "experiment=mixture" in overrides:  # data.sources replaces data.source
        assert "source" not in cfg.data and cfg.data.sources.code.source.corpus == "code"
    if "hparams_search=lr_optuna" in overrides:
        assert cfg.optimized_metric == "val/loss" and "optimizer.lr" in cfg.hydra.sweeper.params


def test_article_preset_prints_its_config_offline(tmp_path):
    proc = run_cli("parallama.cli.train", "experiment=article_180m", "--cfg", "job", cwd=tmp_path)
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["task_name"] == "article_180m" and cfg["global_batch_size"] == 64
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("preset", ["fdr", "limit", "overfit", "profiler"])
def test_debug_presets_run_with_the_defaults(tmp_path, data_cache, preset):
    run = tmp_path / "run"
    proc = train(f"debug={preset}", cwd=tmp_path, cache=data_cache, run_dir=run)
    assert "\nsample:\n" in proc.stdout + proc.stderr
    if preset == "fdr":
        assert not (run / "csv").exists()  # fast_dev_run switches the loggers off
    if preset == "profiler":
        assert list((run / "profiler").glob("*trace*"))
