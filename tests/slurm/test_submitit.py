"""`launcher=slurm` sweeps under a real slurmctld, through Hydra's submitit launcher: a 2-point grid whose jobs
are cancelled at a chosen step (each checkpoints in its own run dir) and resume with `ckpt_path=last`, and an
Optuna search of 2 trials, each a SLURM job with its own run dir and checkpoint."""

from __future__ import annotations

from contextlib import contextmanager

import optuna
import pytest
import yaml
from conftest import TINY, output_of, start_cli
from slurm.jobs import gate_reached, job_env, start_requeued_now
from step_gate import gate
from wandb_files import wandb_records

from parallama.checkpoint.formats import client_state

pytestmark = pytest.mark.multiprocess
# One CPU task per job on a CPU cluster: no GPUs to ask for, and the node's memory, not 200 GB.
SLURM = ["launcher=slurm", "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1"]
SLURM += ["hydra.launcher.mem_gb=1"]


def arguments(tmp, cache, *args: str) -> list[str]:
    return ["-m", *SLURM, *TINY, f"paths.cache_dir={cache}", *args, f"hydra.sweep.dir={tmp / 'sweep'}"]


@contextmanager
def sweep_under_way(tmp, cache, *args: str):
    """The sweep's process (it submits the jobs and waits for them), forked as `run_cli`'s runs are (its jobs are
    SLURM's processes, fresh interpreters), ended at the end if it is still there."""
    proc = start_cli("parallama.cli.train", *arguments(tmp, cache, *args), cwd=tmp, env=job_env())
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)


def sweep(tmp, cache, *args: str) -> tuple[int, str]:
    """The whole sweep: its exit status and output."""
    with sweep_under_way(tmp, cache, *args) as proc:
        proc.wait(600)
    return proc.returncode, output_of(proc)


def submitit_jobs(sweep_dir) -> list[str]:
    """The SLURM jobs submitit made for the sweep (array tasks `<id>_<n>`)."""
    return sorted(p.name for p in (sweep_dir / ".submitit").iterdir() if any(p.glob("*_submitted.pkl")))


@pytest.fixture(scope="module")
def grid(slurm, tmp_path_factory, data_cache):
    """A 2-point grid logging to W&B (offline) too: both jobs held at step 2, the array cancelled (scancel: SLURM
    signals every process of the jobs, W&B's service too), then the same command with ckpt_path=last. (tmp, the
    cancelled sweep's output, the resumed sweep's)"""
    tmp = tmp_path_factory.mktemp("grid")
    points = ["optimizer.lr=1e-3,3e-3", "logger=[csv,wandb]", gate(2, "${paths.output_dir}/gate")]
    with sweep_under_way(tmp, data_cache, *points) as driver:
        for job in ("0", "1"):
            gate_reached(tmp / "sweep" / job / "gate", ranks=1)
        (array,) = {name.split("_")[0] for name in submitit_jobs(tmp / "sweep")}
        slurm.client("scancel", array)
        driver.wait(300)
    cancelled = output_of(driver)
    assert driver.returncode != 0, cancelled[-3000:]
    code, resumed = sweep(tmp, data_cache, *points, "ckpt_path=last")
    assert code == 0, resumed[-4000:]
    return tmp, cancelled, resumed


def test_a_cancelled_job_says_where_it_stopped(grid):
    tmp, cancelled, _ = grid
    # the sweep's end: a line per job, each with where it stopped and the command that resumes the sweep
    lines = sorted(line for line in cancelled.splitlines() if line.startswith("#"))
    assert len(lines) == 2, cancelled[-3000:]
    for job, line in zip(("0", "1"), lines):
        assert line.startswith(
            f"#{job} stopped: stopped by SIGTERM at step 3; last checkpoint: {tmp / 'sweep' / job}"
        )
        assert line.endswith(f"hydra.sweep.dir={tmp / 'sweep'} ckpt_path=last"), line
    assert "Traceback" not in cancelled and "Error executing job" not in cancelled, cancelled[-3000:]
    for job in ("0", "1"):
        log = (tmp / "sweep" / job / "train.log").read_text()
        assert f"stopped by SIGTERM at step 3; last checkpoint: {tmp / 'sweep' / job}" in log


def test_each_job_has_its_run_dir_and_resumes_its_checkpoint(grid):
    tmp, _, output = grid
    assert len(submitit_jobs(tmp / "sweep")) == 4  # 2 SLURM jobs, twice
    lrs = set()
    for job in ("0", "1"):
        run = tmp / "sweep" / job
        lrs.add(yaml.safe_load((run / "resolved_config.yaml").read_text())["optimizer"]["lr"])
        assert client_state(run / "checkpoints" / "last.ckpt")["global_step"] == 4
        log = (run / "train.log").read_text()
        assert f"Restored all states from the checkpoint at {run / 'checkpoints' / 'last.ckpt'}" in log
    assert lrs == {1e-3, 3e-3}


def test_a_cancelled_job_continues_its_wandb_run(grid):
    """The resumed job logs to the W&B run of the cancelled one: two offline runs of one id in each run dir, the
    second with its steps (the first may hold nothing: SLURM's SIGTERM ended its service before it wrote)."""
    tmp, _, _ = grid
    for job in ("0", "1"):
        runs = sorted((tmp / "sweep" / job / "wandb").glob("offline-run-*"))  # by start time
        assert len(runs) == 2 and len({run.name.rsplit("-", 1)[1] for run in runs}) == 1, runs
        records = wandb_records(next(runs[1].glob("run-*.wandb")))
        assert {r.run.run_id for r in records if r.HasField("run")} == {runs[0].name.rsplit("-", 1)[1]}
        assert any(r.HasField("history") for r in records)


def test_an_optuna_search_runs_its_trials_as_slurm_jobs(slurm, tmp_path, data_cache):
    code, output = sweep(tmp_path, data_cache, "hparams_search=lr_optuna", "hydra.sweeper.n_trials=2")
    assert code == 0, output[-4000:]
    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{tmp_path}/logs/optuna.db")
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    assert len(submitit_jobs(tmp_path / "sweep")) == 2  # one array of 2 tasks: asked together
    for trial in trials:
        run = tmp_path / "sweep" / str(trial.number)
        assert trial.user_attrs["output_dir"] == str(run)
        assert client_state(run / "checkpoints" / "last.ckpt")["global_step"] == 4
    results = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert results["best_output_dir"] == str(tmp_path / "sweep" / str(results["best_trial"]))


def test_a_requeued_sweep_job_resumes_and_the_sweep_ends(slurm, tmp_path, data_cache):
    """`scontrol requeue` of a sweep's job held at step 2: it saves at step 3 and leaves no result (an exit), so
    the sweep waits; the requeued run resumes last.ckpt by itself and hands the sweep its result."""
    with sweep_under_way(tmp_path, data_cache, gate(2, tmp_path / "gate")) as driver:
        gate_reached(tmp_path / "gate", ranks=1)
        (job_id,) = submitit_jobs(tmp_path / "sweep")
        slurm.client("scontrol", "requeue", job_id)
        start_requeued_now(slurm, job_id)
        driver.wait(600)
    output = output_of(driver)
    assert driver.returncode == 0, output[-4000:]
    run = tmp_path / "sweep" / "0"
    log = (run / "train.log").read_text()
    assert (
        "stopped by SIGTERM at step 3" in log and f"checkpoint at {run / 'checkpoints' / 'last.ckpt'}" in log
    )
    assert client_state(run / "checkpoints" / "last.ckpt")["global_step"] == 4


def test_a_job_that_fails_ends_the_sweep_with_its_line(slurm, tmp_path, data_cache):
    """A job's one-line error (here ckpt_path=last in a new sweep: nothing to resume) reaches the sweep's process,
    which ends with it; an exit inside submitit's process would leave the sweep waiting for a result."""
    code, output = sweep(tmp_path, data_cache, "ckpt_path=last")
    assert code == 2, output[-3000:]
    (line,) = [line for line in output.splitlines() if line.startswith("#")]
    assert line.startswith("#0 failed: ckpt_path=last: this run's directory "), line
    assert " has no checkpoint (looked for " in line
