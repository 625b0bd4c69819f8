"""W&B and the other loggers: offline without an API key, config and metrics logged, resume continues the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import train
from wandb_files import wandb_run

from parallama.checkpoint.formats import client_state
from parallama.training.loggers import wandb_logger

pytestmark = pytest.mark.usefixtures("no_wandb_account")


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, data_cache) -> tuple[Path, str]:
    """One finished run with every logger (W&B offline, as under `no_wandb_account`): (run dir, its output)."""
    tmp = tmp_path_factory.mktemp("logged")
    (tmp / "home").mkdir()
    env = {"HOME": str(tmp / "home")}  # run_cli drops WANDB_* (the API key, a mode) from the environment
    proc = train("logger=many", "tags=[t1,t2]", cwd=tmp, cache=data_cache, run_dir=tmp / "run", env=env)
    return tmp / "run", proc.stdout + proc.stderr


def test_wandb_offline_logs_config_metrics_and_run_id(logged_run):
    run_dir, out = logged_run
    assert "logging offline" in out
    run = wandb_run(run_dir)
    assert run["group"] == "train" and run["tags"] == ["t1", "t2"]
    assert run["config"]["config"]["optimizer"]["lr"] == 3e-3  # the resolved config
    assert run["config"]["model/params"] > 0 and run["config"]["model/flops_per_token"] > 0
    logged = {key for row in run["history"] for key in row}
    assert {"train/loss", "val/loss", "lr-AdamW/pg1"} <= logged
    assert client_state(run_dir / "checkpoints" / "last.ckpt").get("wandb_run_id") == run["id"]
    assert (run_dir / "csv" / "metrics.csv").exists()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_continues_the_wandb_run(logged_run, tmp_path, data_cache):
    first, second = logged_run[0], tmp_path / "second"
    train(
        "logger=[csv,wandb]",
        "trainer.max_steps=6",
        f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}",
        cwd=tmp_path,
        cache=data_cache,
        run_dir=second,
    )
    run_id = wandb_run(first)["id"]
    assert wandb_run(second)["id"] == run_id
    assert client_state(second / "checkpoints" / "last.ckpt").get("wandb_run_id") == run_id
    assert torch.load(second / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6


def test_run_id_is_read_from_files_and_sharded_folders(tmp_path):
    deepspeed, dcp = tmp_path / "ds.ckpt", tmp_path / "dcp.ckpt"
    (deepspeed / "checkpoint").mkdir(parents=True)
    (deepspeed / "latest").write_text("checkpoint")  # DeepSpeed's pointer to the current tag
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")  # what makes a folder a DCP checkpoint
    torch.save({"wandb_run_id": "a", "state_dict": {}}, tmp_path / "file.ckpt")
    torch.save({"wandb_run_id": "b"}, deepspeed / "checkpoint" / "mp_rank_00_model_states.pt")
    torch.save({"wandb_run_id": "c"}, dcp / "meta.pt")
    assert [client_state(p).get("wandb_run_id") for p in (tmp_path / "file.ckpt", deepspeed, dcp)] == [
        "a",
        "b",
        "c",
    ]
    assert client_state(tmp_path / "file.ckpt").get("missing") is None


def test_wandb_mode_follows_the_api_key(tmp_path, monkeypatch):
    assert wandb_logger(save_dir=str(tmp_path))._wandb_init["mode"] == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_logger(save_dir=str(tmp_path))._wandb_init["mode"] == "online"
    assert wandb_logger(mode="disabled", save_dir=str(tmp_path))._wandb_init["mode"] == "disabled"


LOSE_THE_SERVICE = """
import logging, os, signal, sys
from pathlib import Path
from parallama.training import preemption
from parallama.training.loggers import finish_wandb_run, wandb_logger

logging.basicConfig(level=logging.INFO, format="%(message)s")
logger = wandb_logger(mode="offline", save_dir=sys.argv[1], project="p")
logger.log_metrics({"a": 1.0}, step=0)
children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()
(service,) = [int(p) for p in children if b"wandb-core" in Path(f"/proc/{p}/cmdline").read_bytes()]
os.kill(service, signal.SIGTERM)  # what SLURM's scancel does to every process of the job
os.waitpid(service, 0)
try:
    logger.log_metrics({"a": 2.0}, step=1)
except ConnectionError:
    print("an error without a stop signal")
preemption._stop_signal = signal.SIGTERM  # what PreemptionCheckpoint records
logger.log_metrics({"a": 3.0}, step=2)
logger.log_metrics({"a": 4.0}, step=3)
finish_wandb_run()
print("stopped")
"""


def test_a_wandb_service_lost_to_a_stop_signal_does_not_stop_the_run(tmp_path):
    """SLURM's scancel signals W&B's service too (tests/slurm/test_submitit.py runs it): after the run recorded
    the signal, W&B calls that find the service gone are one warning and the run goes on to save; before, an
    error. No traceback at exit (wandb's exit hook would print one)."""
    proc = subprocess.run([sys.executable, "-c", LOSE_THE_SERVICE, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "an error without a stop signal" in out and "stopped" in out, out
    assert out.count("W&B: its service ended with the SIGTERM") == 1 and "Traceback" not in out, out
