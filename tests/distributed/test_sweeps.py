"""Multirun with every multi-process strategy, Optuna under ddp, and the launcher/experiment/debug presets."""

from __future__ import annotations

import csv
import re

import optuna
import pytest
import yaml
from conftest import TINY, free_port, run_cli, train
from hydra import compose, initialize_config_dir
from wandb_files import wandb_run

from parallama import CONF_DIR
from parallama.checkpoint.formats import client_state

pytestmark = pytest.mark.usefixtures("no_wandb_account")  # W&B picks offline mode by itself


def job_dirs(cwd) -> list:
    """The job directories of the one sweep under cwd/logs (asserting nothing else was created)."""
    (sweep,) = (cwd / "logs" / "train" / "multiruns").iterdir()
    assert [p.name for p in (cwd / "logs" / "train").iterdir()] == ["multiruns"]  # no runs/ of stray children
    return sorted(p for p in sweep.iterdir() if p.is_dir())


def rank_lrs(job) -> dict[int, float]:
    """The peak lr each rank built its optimizer with, from the `[rank r/w, ...] ..., lr X` log lines."""
    text = "".join(log.read_text() for log in job.glob("*.log"))
    return {int(r): float(lr) for r, lr in re.findall(r"\[rank (\d+)/\d+.*, lr ([^\s,]+)", text)}


def peak_logged_lr(job) -> float:
    with open(job / "csv" / "metrics.csv") as f:
        return max(float(row["lr-AdamW/pg1"]) for row in csv.DictReader(f) if row["lr-AdamW/pg1"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp_spawn", "deepspeed"])
def test_multirun_gives_each_job_its_own_directory(tmp_path, data_cache, strategy):
    """Two of the three ways ranks start and end a job: spawned children (ddp_spawn) and DeepSpeed's own cached
    process groups released between jobs. The third, re-run children (ddp; ddp_sharded and fsdp start theirs the
    same way), is the Optuna sweep's below."""
    lrs = [1e-3, 2e-3]
    args = [f"strategy={strategy}", "trainer.devices=2", "optimizer.lr=1e-3,2e-3", "logger=[csv,wandb]"]
    args += [
        "validate_before_training=false"
    ]  # one spawn per ddp_spawn job (validate + fit: test_strategies)
    run_cli("parallama.cli.train", "-m", *TINY, f"paths.cache_dir={data_cache}", *args, cwd=tmp_path)
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
def test_optuna_under_ddp_scores_short_trials_and_prunes_on_every_rank(tmp_path, data_cache):
    """Two 2-rank ddp trials of 3 steps, validating every 2: each rank trains with its trial's lr; trial 0
    (lr 3e-2) learns and is scored by the validation after its last step (3 is no multiple of the interval);
    trial 1 (lr 1e-6) learns nothing and is pruned at step 2 (pruner.n_startup_trials=1): rank 0 alone talks to
    the study, both ranks stop at the same step and save, and the sweep goes on (a rank left waiting in a
    collective would hang until the timeout). MASTER_PORT is fixed (as docs/strategies.md suggests for two runs
    on one node): the second job must not rendezvous with the first job's finished ranks; each job has its own
    W&B run (rank 0's), whose id its checkpoint keeps."""
    args = ["hparams_search=lr_optuna", "hydra.sweeper.n_trials=2", "strategy=ddp", "trainer.devices=2"]
    args += ["trainer.max_steps=3", "pruner.n_startup_trials=1", "logger=[csv,wandb]"]
    args += ["hydra.sweeper.enqueue_trials=[{optimizer.lr:3e-2},{optimizer.lr:1e-6}]"]
    train(*args, cwd=tmp_path, cache=data_cache, timeout=600, env={"MASTER_PORT": str(free_port())})
    jobs = job_dirs(tmp_path)
    assert [job.name for job in jobs] == ["0", "1"]
    for job, lr in zip(jobs, [3e-2, 1e-6]):
        assert yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"] == lr
        assert rank_lrs(job) == pytest.approx({0: lr, 1: lr}, rel=1e-5)  # logged as %g: 6 digits
        assert peak_logged_lr(job) == pytest.approx(lr)
        run = wandb_run(job)  # exactly one offline run: rank 0's
        assert run["config"]["config"]["optimizer"]["lr"] == lr
        assert client_state(job / "checkpoints" / "last.ckpt").get("wandb_run_id") == run["id"]
    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{tmp_path}/logs/optuna.db")
    done, pruned = study.get_trials()
    assert (done.state.name, pruned.state.name) == ("COMPLETE", "PRUNED")
    assert list(done.intermediate_values) == [2, 3] and done.value == done.intermediate_values[3]
    assert pruned.user_attrs["pruned_at_step"] == 2 and list(pruned.intermediate_values) == [2]
    with open(jobs[0] / "csv" / "metrics.csv") as f:  # before training, after step 2 and after the last (3)
        assert [int(r["step"]) for r in csv.DictReader(f) if r["val/loss"]] == [0, 2, 3]
    assert (jobs[1] / "train_ddp_process_1.log").exists()  # the pruned trial's second rank, in its directory
    assert client_state(jobs[1] / "checkpoints" / "last.ckpt")["global_step"] == 2  # every rank saved at 2
    with open(jobs[1] / "csv" / "metrics.csv") as f:
        assert max(int(r["step"]) for r in csv.DictReader(f) if r["train/loss"]) == 2
    results = yaml.safe_load((jobs[0].parent / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"optimizer.lr": 3e-2} and results["best_value"] == done.value


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
