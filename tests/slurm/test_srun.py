"""The documented sbatch script under a real slurmctld (one node, 2 tasks): a job requeued by `scontrol requeue`
(fsdp), or by its own time-limit signal (SIGUSR1; ddp), resumes, and srun's ranks end with the weights of the
local 2-process run that never stopped (each job's ranks are srun's, as in an uninterrupted job); `scancel` stops
every rank with a checkpoint that loads. Each interruption comes at a chosen step (step_gate.PauseAt holds the
ranks at step 2 until the signal is in), never after a sleep."""

from __future__ import annotations

import psutil
import pytest
import torch
from conftest import TINY, layout_weights
from safetensors.torch import load_file
from slurm.jobs import gate_reached, job, output, sbatch, start_requeued_now, wait_done
from step_gate import gate

from parallama.checkpoint.read import load_checkpoint
from parallama.cli.export import main as export_hf

pytestmark = pytest.mark.multiprocess
ARGS = ["trainer.precision=32-true", "seed=7", "callbacks.progress_bar.line_every_n_steps=1"]
STRATEGIES = {"ddp": ["strategy=ddp"], "fsdp": ["strategy=fsdp"]}


@pytest.fixture(scope="module")
def local(tmp_path_factory, data_cache) -> dict:
    """Each strategy's local 2-process run (parallama starts rank 1 itself): what srun's ranks must end with."""
    tmp = tmp_path_factory.mktemp("local")
    return {
        name: layout_weights(tmp / name, *ARGS, *args, ranks=2, batch=4, cwd=tmp, cache=data_cache)
        for name, args in STRATEGIES.items()
    }


def submit(slurm, tmp, cache, strategy: str, *extra: str, options: tuple[str, ...] = ()) -> str:
    overrides = [*TINY, *ARGS, *STRATEGIES[strategy], "data.batch_size=4", f"paths.cache_dir={cache}", *extra]
    return sbatch(slurm, tmp, *overrides, options=options)


def exported(run_dir) -> dict:
    export_hf([f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"out_dir={run_dir / 'hf'}"])
    return load_file(run_dir / "hf" / "model.safetensors")


def assert_same_weights(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)


def run_dir(tmp, job_id: str):
    return tmp / "logs" / "train" / "slurm" / job_id


def assert_ranks_from_slurm(out: str, tmp, job_id: str) -> None:
    """srun started both ranks (Lightning read them from SLURM's variables); parallama started none itself."""
    assert "SLURM auto-requeueing enabled" in out and "GLOBAL_RANK: 1, MEMBER: 2/2" in out, out[-4000:]
    assert not list(run_dir(tmp, job_id).glob("train_ddp_process_*.log"))


def test_scontrol_requeue_resumes_to_the_weights_of_an_uninterrupted_run(slurm, local, tmp_path, data_cache):
    """fsdp: its checkpoint is a collective save, made at the step boundary after SLURM's SIGTERM."""
    job_id = submit(slurm, tmp_path, data_cache, "fsdp", gate(2, tmp_path / "gate"))
    gate_reached(tmp_path / "gate", ranks=2)
    slurm.client("scontrol", "requeue", job_id)
    start_requeued_now(slurm, job_id)
    state = wait_done(slurm, job_id)
    out = output(tmp_path, job_id)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", out[-4000:]
    assert "stopped by SIGTERM at step 3" in out and "Traceback" not in out, out[-4000:]
    assert_ranks_from_slurm(out, tmp_path, job_id)
    assert_same_weights(exported(run_dir(tmp_path, job_id)), local["fsdp"])


def test_the_time_limit_signal_checkpoints_requeues_and_resumes_exactly(slurm, local, tmp_path, data_cache):
    """The job is held at step 2 while its time limit is brought within the script's --signal=USR1@120 of now:
    slurmctld signals SIGUSR1, every rank saves at step 3, rank 0 requeues the job, and it resumes from there."""
    job_id = submit(slurm, tmp_path, data_cache, "ddp", gate(2, tmp_path / "gate"), options=("--time=10",))
    gate_reached(tmp_path / "gate", ranks=2)
    hours, minutes, seconds = job(slurm, job_id)["RunTime"].split(":")  # under a day
    elapsed = int(hours) * 3600 + int(minutes) * 60 + int(seconds)
    limit = (
        elapsed // 60 + 2
    )  # 60-120 s from now: the signal is due at once, with a minute to save and requeue
    slurm.client("scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit}")
    start_requeued_now(slurm, job_id)
    state = wait_done(slurm, job_id)
    out = output(tmp_path, job_id)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", out[-4000:]
    assert "stopped by SIGUSR1 at step 3; last checkpoint: " in out, out[-4000:]
    assert f"requeued SLURM job {job_id}" in out and "Traceback" not in out, out[-4000:]
    assert not list(
        run_dir(tmp_path, job_id).glob("hpc_ckpt_*")
    )  # Lightning's own in-handler save is not used
    assert_ranks_from_slurm(out, tmp_path, job_id)
    assert_same_weights(exported(run_dir(tmp_path, job_id)), local["ddp"])


def test_a_single_task_job_requeues_itself_on_the_time_limit_signal_too(slurm, tmp_path, data_cache):
    """One task (one device: a strategy without a cluster environment): the time-limit signal saves, requeues
    and resumes as under several ranks, ending with the weights of a local single-process run."""
    overrides = [*TINY, *ARGS, "data.batch_size=4", f"paths.cache_dir={data_cache}"]
    expected = layout_weights(tmp_path / "local", *ARGS, ranks=1, batch=4, cwd=tmp_path, cache=data_cache)
    job_id = sbatch(
        slurm, tmp_path, *overrides, gate(2, tmp_path / "gate"), options=("--time=10", "--ntasks-per-node=1")
    )
    gate_reached(tmp_path / "gate", ranks=1)
    hours, minutes, seconds = job(slurm, job_id)["RunTime"].split(":")
    slurm.client("scontrol", "update", f"JobId={job_id}", f"TimeLimit={(int(hours) * 60 + int(minutes)) + 2}")
    start_requeued_now(slurm, job_id)
    state = wait_done(slurm, job_id)
    out = output(tmp_path, job_id)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", out[-4000:]
    assert "stopped by SIGUSR1 at step 3" in out and f"requeued SLURM job {job_id}" in out, out[-4000:]
    assert_same_weights(exported(run_dir(tmp_path, job_id)), expected)


def test_scancel_stops_every_rank_with_a_checkpoint_that_loads(slurm, tmp_path, data_cache):
    job_id = submit(slurm, tmp_path, data_cache, "ddp", gate(2, tmp_path / "gate"))
    gate_reached(tmp_path / "gate", ranks=2)
    ranks = [
        p
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["name"] != "srun"
        and f"hydra.run.dir=logs/train/slurm/{job_id}" in (p.info["cmdline"] or [])
    ]
    assert len(ranks) == 2, [p.info["cmdline"] for p in ranks]
    slurm.client("scancel", job_id)
    state = wait_done(slurm, job_id)
    gone, alive = psutil.wait_procs(ranks, timeout=60)
    out = output(tmp_path, job_id)
    assert state["JobState"] == "CANCELLED" and not alive, out[-4000:]
    assert out.count("stopped by SIGTERM at step 3") == 2 and "Traceback" not in out, out[-4000:]
    assert load_checkpoint(run_dir(tmp_path, job_id) / "checkpoints" / "last.ckpt").meta["global_step"] == 3
