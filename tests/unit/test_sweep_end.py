"""How a sweep ends (parallama.sweeps.jobs): a table of its jobs (printed and in sweep_results.csv), and where a
job did not finish a line per job and exit status 2; a sweeper's bad input in one line."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from parallama.errors import ConfigError
from parallama.sweeps import jobs
from parallama.sweeps.launcher import _Job, ended, rejoin

RESUME = "parallama-train -m optimizer.lr=1e-3,2e-3 hydra.sweep.dir=s ckpt_path=last"


def result(overrides, run_dir, value=None, error=None) -> JobReturn:
    ret = JobReturn(overrides=overrides, working_dir=str(run_dir))
    ret.status, ret.return_value = (JobStatus.FAILED, error) if error else (JobStatus.COMPLETED, value)
    return ret


def finished_run(folder, step=4, **metrics):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "final_metrics.json").write_text(json.dumps({**metrics, "step": step}))
    return folder


def test_a_sweep_that_finished_prints_its_table_and_writes_it(tmp_path, capsys):
    found = jobs.outcomes(
        [
            result(["seed=1", "optimizer.lr=1e-3"], finished_run(tmp_path / "0", **{"val/loss": 3.5}), 3.5),
            result(["seed=1", "optimizer.lr=2e-3"], finished_run(tmp_path / "1", **{"val/loss": 3.25}), 3.25),
        ],
        0,
    )
    jobs.end(found, tmp_path, RESUME)  # no exit: every job is done
    out = capsys.readouterr()
    assert out.out.splitlines()[0].split() == ["job", "state", "optimizer.lr", "val/loss", "run_dir"]
    assert out.out.splitlines()[2].split() == ["1", "done", "2e-3", "3.25", str(tmp_path / "1")]
    assert out.err == ""
    with open(tmp_path / "sweep_results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["optimizer.lr"], r["val/loss"], r["step"]) for r in rows] == [
        ("0", "1e-3", "3.5", "4"),
        ("1", "2e-3", "3.25", "4"),
    ]


def test_a_sweep_with_a_failed_and_a_stopped_job_says_each_in_a_line_and_exits_2(tmp_path, capsys):
    failed = jobs.JobEnded(jobs.FAILED, 2, f"exit status 2: data: ...; its log: {tmp_path}/1/train.log")
    stopped = jobs.JobEnded(jobs.STOPPED, -9, "killed by SIGKILL; no checkpoint was written yet")
    found = jobs.outcomes(
        [
            result(["optimizer.lr=1e-3"], finished_run(tmp_path / "0", **{"val/loss": 3.5}), 3.5),
            result(["optimizer.lr=2e-3"], tmp_path / "1", error=failed),
            result(["optimizer.lr=3e-3"], tmp_path / "2", error=stopped),
        ],
        0,
    )
    with pytest.raises(SystemExit) as exit:
        jobs.end(found, tmp_path, RESUME)
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"#0 done (val/loss 3.5): {tmp_path / '0'}",
        f"#1 failed: exit status 2: data: ...; its log: {tmp_path}/1/train.log",
        f"#2 stopped: killed by SIGKILL; no checkpoint was written yet; resume the sweep with: {RESUME}",
    ]


def test_a_job_of_hydras_submitit_launcher_is_said_by_its_own_line(tmp_path, capsys):
    """launcher=slurm: a job hands the sweep its one line (runtime/launch.py SweepJobEnded)."""
    from parallama.runtime.launch import SweepJobEnded

    stopped = SweepJobEnded.of("stopped by SIGTERM at step 3; last checkpoint: x/last.ckpt", 0)
    (outcome,) = jobs.outcomes([result(["seed=1"], tmp_path, error=stopped)], 5)
    assert (outcome.number, outcome.state, outcome.detail) == (5, jobs.STOPPED, stopped.what)


def process(code: str) -> SimpleNamespace:
    proc = subprocess.run([sys.executable, "-c", code])
    return SimpleNamespace(returncode=proc.returncode)


def test_how_a_launcher_job_ended_in_words(tmp_path):
    job = _Job(1, [], tmp_path, 1, 1)
    job.proc = process("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert ended(job).state == jobs.STOPPED
    assert ended(job).detail == "killed by SIGKILL; no checkpoint was written yet"
    (tmp_path / "train.log").write_text(
        "[x][parallama][WARNING] - stopped by SIGTERM at step 3; last checkpoint: c\n"
    )
    job.proc = process("")
    assert (ended(job).state, ended(job).detail) == (
        jobs.STOPPED,
        "stopped by SIGTERM at step 3; last checkpoint: c",
    )
    (tmp_path / "job.out").write_text(
        "[x][parallama][ERROR] - error: data: the validation split is empty (...)\n"
    )
    job.proc = process("raise SystemExit(2)")
    assert (ended(job).state, ended(job).detail) == (
        jobs.FAILED,
        f"exit status 2: data: the validation split is empty (...); its log: {tmp_path / 'job.out'}",
    )


def test_a_sweep_run_again_with_ckpt_path_last_skips_done_jobs_and_restarts_jobs_without_a_checkpoint(
    tmp_path,
):
    cfg = OmegaConf.create({"trainer": {"max_steps": 4}, "ckpt_path": "last", "optimized_metric": None})
    done = _Job(0, ["ckpt_path=last"], finished_run(tmp_path / "0", **{"val/loss": 3.5}), 1, 1)
    rejoin(done, cfg)
    assert done.done == 3.5
    longer = _Job(0, ["ckpt_path=last"], finished_run(tmp_path / "1", **{"val/loss": 3.5}), 1, 1)
    (longer.dir / "checkpoints").mkdir()
    (longer.dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    rejoin(longer, OmegaConf.merge(cfg, {"trainer": {"max_steps": 8}}))  # trained to 4 of 8 now
    assert longer.done is None and longer.overrides == ["ckpt_path=last"]
    killed = _Job(0, ["ckpt_path=last"], tmp_path / "2", 1, 1)
    rejoin(killed, cfg)
    assert killed.done is None and killed.overrides == ["ckpt_path=last", "ckpt_path=null"]


def test_a_sweepers_bad_input_is_one_line_and_exit_status_2(capsys):
    """Found: a changed Optuna search on an existing study was a 16-line traceback and exit status 1 (Hydra
    prints a sweeper's exception); every sweeper is wrapped so (tests/unit/test_error_paths.py)."""

    @jobs.one_line_errors
    def sweep(self, arguments):
        raise ConfigError("study 'lr' in sqlite:///x.db: its trials ran with ['trainer.max_steps=30'], ...")

    with pytest.raises(SystemExit) as exit:
        sweep(None, [])
    assert exit.value.code == 2
    assert (
        capsys.readouterr().err
        == "error: study 'lr' in sqlite:///x.db: its trials ran with ['trainer.max_steps=30'], ...\n"
    )


def test_the_resume_command_is_the_sweeps_own_with_its_dir_and_ckpt_path_last():
    task = ["optimizer.lr=1e-3,2e-3", "ckpt_path=/old/last.ckpt", "+callbacks.gate={step:2}"]
    hydra = ["hydra.launcher.devices=[0,1]", "hydra.mode=MULTIRUN", "hydra.sweep.dir=old"]
    config = OmegaConf.create({"hydra": {"overrides": {"task": task, "hydra": hydra}}})
    assert jobs.resume_command(config, "hydra.sweep.dir=s", "ckpt_path=last") == (
        "parallama-train -m optimizer.lr=1e-3,2e-3 '+callbacks.gate={step:2}' 'hydra.launcher.devices=[0,1]' "
        "hydra.sweep.dir=s ckpt_path=last"
    )
