"""When and from what a run resumes, in one place: `ckpt_path` resolved (`last`: this run's newest intact
checkpoint; a run directory: that run's), a fresh run refused where it would silently continue an old one, and a
checkpoint checked before Lightning or DeepSpeed reads it (its checksums, weights-only safe, the same model shape,
something left to train, the same data order). Each refusal is one line naming the key; see README, "Long runs".
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from parallama.checkpoint.formats import client_state, verify_checkpoint
from parallama.checkpoint.integrity import note_once, problem, verify
from parallama.errors import ConfigError
from parallama.models import DEFAULT_FAMILY, model_spec
from parallama.runtime.faults import run_checkpoints
from parallama.runtime.launch import first_process


def check_fresh_run(cfg: DictConfig) -> None:
    """A run resumes only when asked: without `ckpt_path`, refuse a run directory that holds last.ckpt.

    Except a requeued SLURM job (SLURM_RESTART_COUNT > 0), which reruns the same command in the same directory
    and so resumes its last.ckpt (`ckpt_path` becomes `last`).
    """
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    if cfg.ckpt_path is not None or not last.exists():
        return
    if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
        cfg.ckpt_path = "last"
        return
    raise ConfigError(f"{last} exists: resume it with ckpt_path=last, or pick a new hydra.run.dir")


def missing_ckpt_path(ckpt_path: str) -> str | None:
    """The error line for a `ckpt_path` (not `last`) that does not exist; None when it does."""
    if Path(ckpt_path).exists():
        return None
    return (
        f"ckpt_path={ckpt_path} does not exist (give a checkpoint file or folder, a run directory, or `last`)"
    )


OWNER = ".owner.json"  # in the run directory: the live run that writes there


@contextmanager
def owning_run_dir(output_dir: str):
    """The run directory belongs to one live run: its first process (global rank 0) records itself in `OWNER`
    for the job's duration, and a second run into the same directory, or `ckpt_path=last` into it, is refused in
    one line while the owner lives (found: two runs in one directory both exited 0, the first one's resume point
    overwritten, metrics.csv interleaved). A record whose process is gone (killed, preempted) is taken over."""
    if not first_process():
        yield
        return
    path = Path(output_dir) / OWNER
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid())}
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            refuse_live_owner(output_dir)
            path.unlink(missing_ok=True)  # its run is gone: take the directory over
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    try:
        yield
    finally:
        if _read_owner(path) == me:
            path.unlink(missing_ok=True)


def refuse_live_owner(output_dir: str) -> None:
    """One line if a live run owns `output_dir` (`owning_run_dir`)."""
    if owner := live_owner(output_dir):
        raise ConfigError(
            f"hydra.run.dir={output_dir} belongs to a live run (pid {owner['pid']} on {owner['host']}); "
            "wait for it to end, or pick another hydra.run.dir"
        )


def live_owner(run_dir: str | os.PathLike) -> dict | None:
    """The live run that owns `run_dir` (`owning_run_dir`), or None."""
    owner = _read_owner(Path(run_dir) / OWNER)
    return owner if owner is not None and _alive(owner) else None


def _read_owner(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):  # gone, or being written this instant
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time (Linux: /proc/<pid>/stat field 22): a reused pid is another process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(owner: dict) -> bool:
    """Whether the recorded process still runs: on this host, the same pid with the same start time; a run on
    another host (a shared filesystem) is taken to be alive."""
    if owner.get("host") != socket.gethostname():
        return True
    return _start_time(int(owner.get("pid", -1))) == owner.get("started") is not None


def resolve_ckpt_path(ckpt_path: str | None, output_dir: str) -> str | None:
    """The checkpoint a run resumes. `last`: this run's (its directory, `hydra.run.dir`) newest intact one; a run
    directory: that run's; a checkpoint: itself, refused if it fails its checksums. Never another run's newest
    (found: `ckpt_path=last` in a new run directory resumed an unrelated run)."""
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        return checkpoint_of(ckpt_path)
    partial = Path(output_dir) / "checkpoints" / "last.ckpt.partial"  # its first save was cut off (atomic.py)
    if not run_checkpoints(output_dir) and partial.exists():
        raise ConfigError(
            f"ckpt_path=last: this run's only checkpoint is {partial}, a save that was cut off before it completed "
            "(nothing to resume); start afresh in a new hydra.run.dir, or give ckpt_path=<a whole checkpoint>"
        )
    return newest_intact(output_dir, "ckpt_path=last", f"this run's directory {output_dir}")


def checkpoint_of(ckpt_path: str) -> str:
    """An explicit `ckpt_path`: a run directory's newest intact checkpoint, or a checkpoint that passes its
    checksums (refused in one line otherwise); absolute."""
    if (line := missing_ckpt_path(ckpt_path)) is not None:
        raise ConfigError(line)
    path = Path(ckpt_path).resolve()
    if not is_run_dir(path):
        verify(path)
        return str(path)
    if owner := live_owner(path):  # still writing: its next save would race this run's
        raise ConfigError(
            f"ckpt_path={ckpt_path} is a run that is still alive (pid {owner['pid']} on {owner['host']}); "
            "wait for it to end (or stop it: it saves last.ckpt on SIGTERM), then resume"
        )
    return newest_intact(path, f"ckpt_path={ckpt_path}", f"the run directory {path}")


def is_run_dir(path: Path) -> bool:
    """A folder with `checkpoints/` that is not itself a checkpoint folder (DeepSpeed's `latest`, DCP's `.metadata`)."""
    return (path / "checkpoints").is_dir() and not any((path / f).exists() for f in ("latest", ".metadata"))


def newest_intact(run_dir: str | os.PathLike, key: str, where: str) -> str:
    """The first of `run_checkpoints` that passes its checksums, saying in one line which it skipped and why."""
    skipped = []
    for candidate in run_checkpoints(run_dir):
        if (why := problem(candidate)) is None:
            if skipped:
                note_once(f"{key}: resuming {candidate}; skipped: {'; '.join(skipped)}")
            return str(candidate)
        skipped.append(why)
    if skipped:
        raise ConfigError(f"{key}: no checkpoint of {where} is intact: {'; '.join(skipped)}")
    raise ConfigError(
        f"{key}: {where} has no checkpoint (looked for {Path(run_dir) / 'checkpoints' / '*.ckpt'}); resume "
        "another run with ckpt_path=<its run dir or a checkpoint> (or hydra.run.dir=<its run dir> "
        "ckpt_path=last), or drop ckpt_path to start afresh"
    )


def check_model_matches(ckpt_path: str, model: dict, strict: bool = True) -> dict:
    """The checkpoint was trained with `model`'s settings (keys `model` lacks are not compared); returns its
    client state. `strict=False` (the preflight): a checkpoint without a parallama model config passes, for
    the run's own check to word."""

    ckpt_path = checkpoint_of(ckpt_path)  # a run directory: its newest intact checkpoint
    state = client_state(ckpt_path)
    saved = (state.get("hyper_parameters") or {}).get("model")
    if not isinstance(saved, dict):
        if not strict:
            return state
        raise ConfigError(f"ckpt_path={ckpt_path} is not a parallama checkpoint (no hyper_parameters.model)")
    fields = {"family": saved.get("family") or DEFAULT_FAMILY, **vars(model_spec(saved).build_config(saved))}
    for key, value in fields.items():
        if model.get(key, value) != value:
            raise ConfigError(
                f"ckpt_path={ckpt_path} was trained with model.{key}={value} but this run has "
                f"model.{key}={model[key]}; resume with the checkpoint's model settings"
            )
    return state


def check_resume(ckpt_path: str, model: dict, datamodule, max_steps: int) -> None:
    """Before `trainer.fit(ckpt_path=...)`: Lightning and DeepSpeed unpickle the checkpoint in full, so nothing in
    it may run code; then the same model shape, something left to train, the same data order."""
    verify_checkpoint(ckpt_path)
    state = check_model_matches(ckpt_path, model)
    step = state.get("global_step", 0)
    if 0 < max_steps <= step:
        raise ConfigError(
            f"ckpt_path={ckpt_path} is at step {step} and trainer.max_steps={max_steps}: nothing is left to "
            f"train; raise trainer.max_steps to continue the run"
        )
    for scheduler in state.get("lr_schedulers") or []:  # a torch scheduler resumes with its saved length
        length = scheduler.get("total_steps")
        if 0 < max_steps and isinstance(length, int) and length < max_steps:
            raise ConfigError(
                f"ckpt_path={ckpt_path} has an LR scheduler of {length} steps (its total_steps, which it keeps) and "
                f"trainer.max_steps={max_steps} is longer; resume with trainer.max_steps={length}"
            )
    saved_data = state.get(type(datamodule).__name__)
    if saved_data:  # the data-parallel size and batch size may change: the data position is a global sample
        datamodule.check_resume(saved_data, source=f"ckpt_path={ckpt_path}")
