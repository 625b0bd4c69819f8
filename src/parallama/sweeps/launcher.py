"""A sweep's jobs spread over this machine's devices: as many at once as fit, each in a process of its own pinned
to its own devices (`hydra/launcher: devices`, the `launcher=local` default).

Each job runs as `parallama-train <its overrides> hydra.run.dir=<its job dir> hydra.mode=RUN` with
CUDA_VISIBLE_DEVICES set to its GPUs (or, on a CPU-only machine, its processes pinned to its own cores,
`runtime.launch.pin_to_job_cores`, and OMP_NUM_THREADS set to match) and a MASTER_PORT of its own, so a trial
that is itself a ddp/fsdp/deepspeed run starts its ranks (runtime/launch.py) exactly as a single run does and
never meets another job's process group.
`n_jobs` defaults to devices // devices per job (`trainer.devices`); jobs start in order as devices free up.

Why not Hydra's joblib launcher: its workers are long-lived joblib processes whose `__main__` is loky's worker, so
a ddp trial's ranks (started by re-running `__main__`) would not run parallama, jobs share a worker's process
group and environment, and it has no notion of which devices a job may use. Nor submitit's local executor
(hydra/launcher=submitit_local): its `__main__` is submitit's, and every job gets the same first GPUs.
tests/unit/test_library_gaps.py runs both: test_joblib_jobs_run_in_joblib_workers_that_share_their_environment,
test_submitit_local_jobs_run_submitit_and_all_get_the_same_gpus.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, ListConfig, open_dict

from parallama.distributed.dims import processes_per_node, uses_gpu
from parallama.errors import ConfigError
from parallama.runtime.faults import run_checkpoints
from parallama.runtime.launch import JOB_CORES_ENV, JOB_RETURN_ENV, free_port, job_command
from parallama.sweeps.jobs import FAILED, STOPPED, JobEnded, SweepInterrupted
from parallama.training.report import final_metrics

log = logging.getLogger(__name__)

# The launcher's own settings and the run directories: the job's process gets its own.
_NOT_PASSED = ("hydra.mode", "hydra.run.", "hydra.output_subdir", "hydra.job.name", "hydra.launcher")


@dataclass
class _Job:
    idx: int
    overrides: list[str]
    dir: Path
    need: int  # devices (GPUs, or CPU cores) this job takes
    processes: int
    devices: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    started: float = 0.0
    done: float | None = None  # a finished job of a sweep run again (`rejoin`): its value, not run again


class DeviceLauncher(Launcher):
    """Runs a sweep's jobs on this machine, `n_jobs` at a time, each on devices of its own.

    devices: the devices to share out (null: the GPUs this process sees when the jobs use GPUs, else the CPU cores
    it may run on). n_jobs: jobs at once (null: devices // devices per job).
    """

    def __init__(self, n_jobs: int | None = None, devices: list | None = None) -> None:
        self.n_jobs, self.devices = n_jobs, devices
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def parallel_jobs(self) -> int:
        """How many jobs of the sweep's own config run at once (the Optuna sweeper asks this many trials)."""
        trainer = self.config.trainer
        gpu = uses_gpu(trainer.accelerator)
        return jobs_at_once(self.n_jobs, len(self.pool(gpu)), job_devices(trainer, gpu))

    def pool(self, gpu: bool) -> list[str]:
        if self.devices is not None:
            return [str(d) for d in self.devices]
        if gpu:
            import torch  # torch-free module

            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return [str(core) for core in sorted(os.sched_getaffinity(0))]

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        gpu = uses_gpu(self.config.trainer.accelerator)
        pool = self.pool(gpu)
        jobs = [self._job(initial_job_idx + i, list(o), gpu, len(pool)) for i, o in enumerate(job_overrides)]
        at_once = jobs_at_once(self.n_jobs, len(pool), jobs[0].need) if jobs else 1
        kind = "GPU" if gpu else "CPU core"
        log.info(f"Launching {len(jobs)} jobs, {at_once} at a time on {len(pool)} {kind}s {pool}")
        return self._run(jobs, pool, at_once, gpu)

    def _job(self, idx: int, overrides: list[str], gpu: bool, pool_size: int) -> _Job:
        """The job's directory and the devices it needs, from its config as Hydra composes it."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg):
            cfg.hydra.job.id = cfg.hydra.job.num = idx
        HydraConfig.instance().set_config(cfg)  # resolves ${hydra.job.num} in the subdir
        job_dir = Path(cfg.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir)
        need = job_devices(cfg.trainer, gpu)
        if cfg.trainer.num_nodes > 1:
            raise ConfigError("trainer.num_nodes > 1: a sweep over several nodes needs launcher=slurm")
        ids = _devices(cfg.trainer)
        if gpu and (isinstance(ids, list) or (isinstance(ids, str) and "," in ids)):
            raise ConfigError(
                f"trainer.devices={cfg.trainer.devices} names GPUs, but each sweep job gets GPUs of its own: give a "
                "count (trainer.devices=2) and choose the GPUs with hydra.launcher.devices=[...]"
            )
        if need > pool_size:
            raise ConfigError(
                f"trainer.devices={cfg.trainer.devices} but the sweep has {pool_size} device(s) to share out "
                "(hydra.launcher.devices)"
            )
        processes = need if gpu else cpu_processes(cfg.trainer)
        if not gpu and self.n_jobs:  # fewer jobs than cores: each gets its share
            need = max(need, pool_size // self.n_jobs)
        job = _Job(idx, overrides, job_dir, need, processes)
        if cfg.get("ckpt_path") == "last":
            rejoin(job, cfg)
        return job

    def _run(self, jobs: list[_Job], pool: list[str], at_once: int, gpu: bool) -> list[JobReturn]:
        """The jobs, `at_once` at a time. Ctrl-C or SIGTERM: the jobs under way are stopped (each saves last.ckpt)
        and waited for, none is started, and `SweepInterrupted` says where each job stands."""
        free, pending, running = list(pool), [j for j in jobs if j.done is None], []
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        signal.signal(signal.SIGTERM, _raise_interrupt)  # killed: end the jobs first (they checkpoint)
        interrupted = None
        try:
            while pending or running:
                while pending and len(running) < at_once and len(free) >= pending[0].need:
                    job = pending.pop(0)
                    job.devices, free = free[: job.need], free[job.need :]
                    self._start(job, gpu, quiet=at_once > 1)
                    running.append(job)
                time.sleep(0.2)
                for job in [j for j in running if j.proc.poll() is not None]:
                    running.remove(job)
                    free = sorted(free + job.devices, key=pool.index)
                    log.info(
                        f"#{job.idx} ended (status {job.proc.returncode}, {time.time() - job.started:.0f} s)"
                    )
        except KeyboardInterrupt as err:
            interrupted = getattr(err, "signal_name", "SIGINT")
            for signum in handlers:  # the jobs save and end: a second signal does not cut that short
                signal.signal(signum, signal.SIG_IGN)
            _stop(running)
        except BaseException:
            _stop(running)
            raise
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        results = [self._result(job) for job in jobs]
        if interrupted is not None:
            raise SweepInterrupted(interrupted, results)
        return results

    def _start(self, job: _Job, gpu: bool, quiet: bool) -> None:
        job.dir.mkdir(parents=True, exist_ok=True)
        result = job.dir / ".job_return.json"
        result.unlink(missing_ok=True)
        hydra_cfg = self.config.hydra
        passed = [o for o in hydra_cfg.overrides.hydra if not o.lstrip("+~").startswith(_NOT_PASSED)]
        command = job_command(hydra_cfg, [*job.overrides, *passed], str(job.dir))
        env = {**os.environ, "MASTER_PORT": str(free_port()), JOB_RETURN_ENV: str(result)}
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(job.devices)
        else:  # the job pins itself, and its ranks, at start (no preexec_fn: unsafe in a process with threads)
            env[JOB_CORES_ENV] = ",".join(job.devices)
            env.setdefault("OMP_NUM_THREADS", str(max(1, len(job.devices) // job.processes)))
        out = open(job.dir / "job.out", "w") if quiet else None  # jobs at once: each prints to its own file
        devices = ("GPU " if gpu else "CPU cores ") + ",".join(job.devices)
        log.info(f"#{job.idx} on {devices}: {' '.join(filter_overrides(job.overrides))} -> {job.dir}")
        job.proc = subprocess.Popen(
            command,
            env=env,
            cwd=os.getcwd(),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
        job.started = time.time()
        if out is not None:
            out.close()

    def _result(self, job: _Job) -> JobReturn:
        ret = JobReturn(
            overrides=job.overrides, working_dir=str(job.dir), task_name=self.config.hydra.job.name
        )
        result = job.dir / ".job_return.json"
        if job.done is not None:
            ret.status, ret.return_value = JobStatus.COMPLETED, job.done
        elif job.proc is None:
            ret.status, ret.return_value = JobStatus.FAILED, JobEnded(STOPPED, None, "not started")
        elif job.proc.returncode == 0 and result.exists():
            ret.status, ret.return_value = JobStatus.COMPLETED, json.loads(result.read_text())
        else:
            ret.status, ret.return_value = JobStatus.FAILED, ended(job)
        return ret


def rejoin(job: _Job, cfg: DictConfig) -> None:
    """A job of a sweep run again with `ckpt_path=last` (the command its sweep's end prints): one that had
    finished (its final metrics at trainer.max_steps) is done, not run again, where its resume was refused as
    "nothing is left to train"; one that wrote no checkpoint (killed before its first save, or never started)
    starts afresh."""

    metrics, steps = final_metrics(job.dir), cfg.trainer.max_steps
    if metrics is not None and (steps is None or steps <= 0 or metrics.get("step", -1) >= steps):
        job.done = metrics.get(cfg.get("optimized_metric") or "val/loss")
        log.info(f"#{job.idx} finished already: {job.dir}")
    elif not run_checkpoints(job.dir):
        job.overrides = [*job.overrides, "ckpt_path=null"]
        log.info(f"#{job.idx} wrote no checkpoint: it starts afresh in {job.dir}")


def _checkpoint_note(run_dir: Path) -> str:
    """A job's checkpoint, without a resume of its own: the sweep's resume line (jobs.py) resumes every job."""
    found = run_checkpoints(run_dir)
    return f"last checkpoint: {found[0]}" if found else "no checkpoint was written yet"


def ended(job: _Job) -> JobEnded:
    """How a job's process that gave no result ended, in words: stopped (by a signal it saved at, or killed), or
    failed with its error line and where its log is."""
    status = job.proc.returncode
    logs = [p for p in (job.dir / "job.out", job.dir / "train.log") if p.exists()]
    if status < 0:
        return JobEnded(STOPPED, status, f"killed by {_signal_name(-status)}; {_checkpoint_note(job.dir)}")
    if status == 0:  # a stop signal: it saved last.ckpt and said where
        return JobEnded(STOPPED, status, _said(logs, "stopped by ") or "ended without a result")
    said = _said(logs, "error: ") or "its error is above"
    where = f"; its log: {logs[0]}" if logs else ""
    return JobEnded(FAILED, status, f"exit status {status}: {said.removeprefix('error: ')}{where}")


def _said(logs: list[Path], marker: str) -> str | None:
    """The last line of the job's output (job.out) or log (train.log) that holds `marker`, from the marker on."""
    for path in logs:
        lines = [line for line in path.read_text(errors="replace").splitlines() if marker in line]
        if lines:
            return lines[-1][lines[-1].index(marker) :]
    return None


def _stop(running: list[_Job]) -> None:
    """SIGTERM to the jobs under way (each saves last.ckpt at its next step), then wait for them to end."""
    for job in running:
        job.proc.send_signal(signal.SIGTERM)
    for job in running:
        job.proc.wait()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _Signalled(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(_signal_name(signum))
        self.signal_name = _signal_name(signum)


def _raise_interrupt(signum, frame) -> None:
    raise _Signalled(signum)


def cpu_processes(trainer: DictConfig) -> int:
    return processes_per_node(_devices(trainer), "cpu")


def job_devices(trainer: DictConfig, gpu: bool) -> int:
    """The GPUs a job uses (`trainer.devices`: a count, ids, or all), or on CPU its processes' cores (one each)."""
    if not gpu:
        return cpu_processes(trainer)
    return processes_per_node(_devices(trainer), "gpu")


def _devices(trainer: DictConfig):
    devices = trainer.devices
    return list(devices) if isinstance(devices, ListConfig) else devices  # ids: [0, 3]


def jobs_at_once(n_jobs: int | None, devices: int, per_job: int) -> int:
    """`hydra.launcher.n_jobs`, or as many jobs as the devices hold (at least one)."""
    if n_jobs is not None:
        if n_jobs < 1:
            raise ConfigError(
                f"hydra.launcher.n_jobs={n_jobs}: use an integer >= 1 (or null: devices // job)"
            )
        return n_jobs
    return max(1, devices // max(1, per_job))
