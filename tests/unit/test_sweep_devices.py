"""How the device launcher shares out a machine: the pool of devices, and how many jobs fit at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from parallama.errors import ConfigError
from parallama.runtime.launch import JOB_CORES_ENV
from parallama.sweeps.launcher import DeviceLauncher, job_devices, jobs_at_once


def test_jobs_at_once_is_devices_over_devices_per_job():
    assert jobs_at_once(None, devices=8, per_job=2) == 4
    assert jobs_at_once(None, devices=8, per_job=3) == 2
    assert jobs_at_once(None, devices=1, per_job=2) == 1  # a job bigger than the pool still runs alone
    assert jobs_at_once(3, devices=8, per_job=1) == 3  # hydra.launcher.n_jobs wins
    with pytest.raises(ConfigError, match="hydra.launcher.n_jobs=0"):
        jobs_at_once(0, devices=8, per_job=1)


def test_the_pool_is_the_visible_gpus_or_the_cores(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5")
    assert DeviceLauncher().pool(gpu=True) == ["2", "3", "5"]  # the physical ids a job is given
    assert DeviceLauncher(devices=[0, 1]).pool(gpu=True) == ["0", "1"]
    assert DeviceLauncher().pool(gpu=False) == [str(c) for c in sorted(os.sched_getaffinity(0))]


@pytest.mark.parametrize(
    "devices, gpu, need", [(1, True, 1), (2, True, 2), ([0, 3], True, 2), ("0,1,2", True, 3), (2, False, 2)]
)
def test_a_job_needs_its_trainer_devices(devices, gpu, need):
    trainer = OmegaConf.create({"devices": devices, "accelerator": "gpu" if gpu else "cpu", "num_nodes": 1})
    assert job_devices(trainer, gpu) == need


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to pin to one of them")
def test_a_cpu_job_pins_itself_to_the_cores_in_its_environment():
    """The launcher hands a CPU job its cores in PARALLAMA_JOB_CORES; each of its processes pins itself at start."""
    core = max(os.sched_getaffinity(0))
    code = "from parallama.runtime.launch import pin_to_job_cores as p; import os; p(); print(os.sched_getaffinity(0))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, JOB_CORES_ENV: str(core)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == str({core}), out.stderr
