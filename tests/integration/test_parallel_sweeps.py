"""Sweeps that use every device: a grid of two one-process jobs at once, and a 4-trial Optuna study on 2
"devices" (CPU cores) running 2 trials at a time that prunes, reports its best trial, and continues where an
interrupted sweep stopped."""

from __future__ import annotations

import csv
import json
import os
import signal
import threading
import time
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import TINY, output_of, run_cli, start_cli, train
from step_gate import gate
from wandb_files import wandb_run

from parallama.checkpoint.formats import client_state

TESTS = Path(__file__).resolve().parents[1]  # on a job's PYTHONPATH: step_gate
pytestmark = pytest.mark.usefixtures("no_wandb_account")  # W&B picks offline mode by itself


def sweep_dir(cwd: Path) -> Path:
    (sweep,) = (cwd / "logs" / "train" / "multiruns").iterdir()
    return sweep


def jobs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name))


def span(job: Path) -> tuple[float, float]:
    """When the job's run began (its Hydra wrote .hydra/config.yaml) and ended (it wrote its return value)."""
    return (job / ".hydra" / "config.yaml").stat().st_mtime, (job / ".job_return.json").stat().st_mtime


def overlap(a: Path, b: Path) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def train_steps(job: Path) -> list[int]:
    with open(job / "csv" / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]]


def config_lr(job: Path) -> float:
    return yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["optimizer"]["lr"]


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory, data_cache) -> tuple[Path, str]:
    """Two one-process jobs on a pool of 2 CPU cores: both at once, each pinned to its own core."""
    cwd = tmp_path_factory.mktemp("grid")
    args = ["optimizer.lr=1e-3,2e-3", "logger=[csv,wandb]", "hydra.launcher.devices=[0,1]"]
    proc = run_cli("parallama.cli.train", "-m", *TINY, f"paths.cache_dir={data_cache}", *args, cwd=cwd)
    return sweep_dir(cwd), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def grid(grid_run) -> Path:
    return grid_run[0]


def test_a_grid_ends_with_a_table_of_its_jobs_printed_and_in_a_csv(grid_run):
    sweep, output = grid_run
    with open(sweep / "sweep_results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["state"], r["optimizer.lr"], r["run_dir"]) for r in rows] == [
        ("0", "done", "0.001", str(sweep.absolute() / "0")),
        ("1", "done", "0.002", str(sweep.absolute() / "1")),
    ]
    final = [json.loads((sweep / job / "final_metrics.json").read_text()) for job in ("0", "1")]
    assert [float(r["val/loss"]) for r in rows] == [m["val/loss"] for m in final]
    header = next(line for line in output.splitlines() if line.startswith("job  state"))
    assert header.split() == ["job", "state", "optimizer.lr", "val/loss", "val/ppl", "train/loss", "run_dir"]
    assert f"results: logs/train/multiruns/{sweep.name}/sweep_results.csv\n" in output
    assert "Error executing job" not in output and "Traceback" not in output


def test_a_killed_job_ends_the_sweep_in_a_line_per_job_and_the_sweep_resumes_as_a_whole(tmp_path, data_cache):
    """Found: a job killed with kill -9 ended the sweep in Hydra's `Error executing job` and a 20-line
    traceback (exit status 1), and the same sweep run again with ckpt_path=last reported the job that had finished
    as FAILED ("nothing is left to train"). Job #1 is held at step 2 (step_gate) and killed there, before its
    first checkpoint; job #0 passes the gate (its mark is there already) and finishes."""
    sweep = tmp_path / "sweep"
    (sweep / "0" / "gate").mkdir(parents=True)
    (sweep / "0" / "gate" / "rank0").write_text("passed")
    args = [*TINY, f"paths.cache_dir={data_cache}", "optimizer.lr=1e-3,2e-3", "hydra.launcher.devices=[0,1]"]
    args += [gate(2, "${paths.output_dir}/gate"), f"hydra.sweep.dir={sweep}"]
    env = {"PYTHONPATH": str(TESTS)}
    ended = {}
    first = threading.Thread(  # the sweep, while this thread kills its job #1 at the gate
        target=lambda: ended.update(proc=run_cli("parallama.cli.train", "-m", *args, cwd=tmp_path, env=env,
                                                 check=False, timeout=300))
    )  # fmt: skip
    first.start()
    mark, deadline = sweep / "1" / "gate" / "rank0", time.time() + 240
    while not mark.exists() or not mark.read_text().strip():
        assert first.is_alive() and time.time() < deadline, ended
        time.sleep(0.2)
    os.kill(int(mark.read_text().split()[-1]), signal.SIGKILL)
    first.join()
    out = ended["proc"].stdout + ended["proc"].stderr
    assert ended["proc"].returncode == 2, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("#") and ": " in line][-2:]
    resume = f"hydra.sweep.dir={sweep} ckpt_path=last"
    assert lines[0].startswith("#0 done (val/loss ") and lines[0].endswith(str(sweep / "0"))
    assert lines[1].startswith(
        "#1 stopped: killed by SIGKILL; no checkpoint was written yet; resume the sweep"
    )
    assert lines[1].endswith(resume), lines[1]
    assert "Error executing job" not in out and "Traceback" not in out
    log0 = (sweep / "0" / "train.log").read_text()

    again = run_cli(
        "parallama.cli.train", "-m", *args[:-1], *resume.split(), cwd=tmp_path, env=env, timeout=300
    )
    out = again.stdout + again.stderr
    assert "#0 finished already" in out and "#1 wrote no checkpoint: it starts afresh" in out
    assert (sweep / "0" / "train.log").read_text() == log0  # not run again
    assert train_steps(sweep / "1")[-4:] == [1, 2, 3, 4]
    with open(sweep / "sweep_results.csv") as f:
        assert [r["state"] for r in csv.DictReader(f)] == ["done", "done"]


def test_grid_jobs_run_at_once_each_with_its_own_run(grid):
    first, second = jobs(grid)
    assert overlap(first, second)  # as the runs themselves logged it
    for job, lr in zip((first, second), (1e-3, 2e-3)):
        assert config_lr(job) == lr
        assert train_steps(job)[-1] == 4  # each trained to the end (step 4)
        run = wandb_run(job)  # exactly one offline W&B run per job
        assert run["config"]["config"]["optimizer"]["lr"] == lr
        assert client_state(job / "checkpoints" / "last.ckpt").get("wandb_run_id") == run["id"]
        assert (job / "job.out").stat().st_size > 0  # jobs at once print to their own files
    assert wandb_run(first)["id"] != wandb_run(second)["id"]
    # each job pinned itself to the core the launcher gave it (the process's affinity, as it logged it)
    assert "pinned to CPU cores 0\n" in (first / "job.out").read_text()
    assert "pinned to CPU cores 1\n" in (second / "job.out").read_text()


# 4 trials, 2 at a time: trials 0 and 1 (enqueued, lr 1e-2 and 3e-2, both learn) finish first; trial 2 (enqueued,
# lr 1e-6: learns nothing) then reports a val/loss worse than their median at step 2 and is pruned; trial 3 is
# TPE's (seeded). The median pruner may prune from the 3rd trial on (n_startup_trials=2).
OPTUNA = [
    "hparams_search=lr_optuna",
    "hydra.sweeper.n_trials=4",
    "hydra.launcher.devices=[0,1]",
    "pruner.n_startup_trials=2",
    "hydra.sweeper.enqueue_trials=[{optimizer.lr:1e-2},{optimizer.lr:3e-2},{optimizer.lr:1e-6}]",
]


@pytest.fixture(scope="module")
def study_run(tmp_path_factory, data_cache):
    cwd = tmp_path_factory.mktemp("optuna")
    proc = train(*OPTUNA, cwd=cwd, cache=data_cache, timeout=600)
    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{cwd}/logs/optuna.db")
    return sweep_dir(cwd), study, proc.stdout + proc.stderr


def test_optuna_runs_two_trials_at_a_time(study_run):
    sweep, _, _ = study_run
    t0, t1, t2, t3 = jobs(sweep)
    assert overlap(t0, t1) and overlap(t2, t3)
    assert span(t2)[0] > max(span(t0)[1], span(t1)[1])  # the second pair was asked after the first ended


def test_optuna_prunes_the_trial_that_learns_nothing(study_run):
    sweep, study, _ = study_run
    trials = study.get_trials()
    assert [t.params["optimizer.lr"] for t in trials[:3]] == [1e-2, 3e-2, 1e-6]
    assert [t.state.name for t in trials[:3]] == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert trials[2].user_attrs["pruned_at_step"] == 2
    assert list(trials[2].intermediate_values) == [2]  # reported at step 2, then stopped
    assert train_steps(jobs(sweep)[2]) == [1, 2]  # the pruned trial trained 2 steps of 4
    assert client_state(jobs(sweep)[2] / "checkpoints" / "last.ckpt") is not None  # and ended as a run does
    for t in trials[:2]:  # a finished trial reported at each validation of fit (not the one before it)
        assert list(t.intermediate_values) == [2, 4] and t.value == t.intermediate_values[4]


def test_optuna_reports_the_best_trial_with_its_checkpoint(study_run):
    sweep, study, output = study_run
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    best = min((t for t in study.get_trials() if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert results["best_trial"] == best.number and results["best_value"] == pytest.approx(best.value)
    assert results["best_params"] == best.params
    assert Path(results["best_checkpoint"]).is_file()
    assert Path(results["best_checkpoint"]).parent.parent == jobs(sweep)[best.number]
    assert (
        results["trials"]["pruned"] >= 1 and results["trials"]["complete"] + results["trials"]["pruned"] == 4
    )
    assert "best_checkpoint" in output


def test_an_interrupted_study_continues_from_its_database(tmp_path, data_cache):
    """SIGTERM while the first trial trains: its job checkpoints and ends, the sweep exits; the same command
    then runs that trial's parameters again from its last.ckpt, and only the trials still missing. The trial is
    held at step 2 until the signal is in (step_gate), so it stops at step 3 however slow the machine."""
    args = [*TINY, f"paths.cache_dir={data_cache}", "hparams_search=lr_optuna", "hydra.sweeper.n_trials=2"]
    args += ["hydra.launcher.n_jobs=1", gate(2, tmp_path / "gate")]  # later runs pass the gate
    sweep = start_cli("parallama.cli.train", *args, cwd=tmp_path, env={"PYTHONPATH": str(TESTS)})
    log = tmp_path / "logs" / "train" / "multiruns"
    deadline = time.time() + 240
    while not (tmp_path / "gate" / "rank0").exists():
        assert sweep.poll() is None and time.time() < deadline, output_of(sweep)[-3000:]
        time.sleep(0.5)
    sweep.send_signal(signal.SIGTERM)
    sweep.wait(120)
    output = output_of(sweep)
    assert sweep.returncode == 2, output[-3000:]
    (line,) = [line for line in output.splitlines() if line.startswith("#0 ")]  # one line per job: one job
    assert line.startswith("#0 stopped: stopped by SIGTERM at step 3; last checkpoint: ")
    assert "; resume the sweep with: parallama-train -m " in line and " hparams_search=lr_optuna " in line
    assert "KeyboardInterrupt" not in output and "Traceback" not in output
    (first,) = log.iterdir()
    interrupted = client_state(first / "0" / "checkpoints" / "last.ckpt")
    assert interrupted["global_step"] == 3  # stopped mid-training (test_sweep_continue: after its fit)

    proc = run_cli("parallama.cli.train", *args, cwd=tmp_path, timeout=600, env={"PYTHONPATH": str(TESTS)})
    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{tmp_path}/logs/optuna.db")
    t0, t1, t2 = study.get_trials()
    assert t0.state.name == "FAIL" and t1.user_attrs["retry_of"] == 0 and t1.params == t0.params
    assert t1.user_attrs["resume_from"] == str(first / "0" / "checkpoints" / "last.ckpt")
    assert t1.state.name == "COMPLETE" and t2.state.name in ("COMPLETE", "PRUNED")
    (second,) = [p for p in log.iterdir() if p != first]
    assert [p.name for p in jobs(second)] == ["0", "1"]  # 2 jobs: the retried trial and the missing one
    retried = train_steps(jobs(second)[0])
    assert retried == [4]  # continued from the checkpoint (step 3) to the end
    assert "trial 0 was interrupted" in proc.stdout + proc.stderr
