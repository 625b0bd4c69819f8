"""When and from what a run resumes, in one place: `ckpt_path` resolved (`last`), a fresh run refused where it
would silently continue an old one, and a checkpoint checked before Lightning or DeepSpeed reads it (weights-only
safe, the same model shape, something left to train, the same data order). Each refusal is one line naming the
key; see README, "Long runs".
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from parallama.checkpoint.formats import client_state
from parallama.errors import ConfigError


def last_checkpoint_note(output_dir: str) -> str:
    last = Path(output_dir) / "checkpoints" / "last.ckpt"
    return f"last checkpoint: {last}" if last.exists() else "no checkpoint was written yet"


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
    return f"ckpt_path={ckpt_path} does not exist (give a checkpoint file/folder, or `last`)"


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


def first_process() -> bool:
    """Global rank 0 of the job before any process group exists: no launcher's rank, or rank 0 of it."""
    ranks = (os.environ.get(k, "0") for k in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))
    return all(r == "0" for r in ranks)


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


def resolve_ckpt_path(ckpt_path: str | None, output_dir: str, runs_root: str) -> str | None:
    """`last`: this run's last checkpoint, else the newest `last` checkpoint of the runs under runs_root
    (`logs/<task>/runs`: a sweep's jobs are not "the newest run"; resume one by its path).

    `last.ckpt.old` counts too: a folder checkpoint is `.old` for an instant while its successor is swapped in,
    and a kill at that instant must not make `last` fall back to an older run.
    """
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        if (line := missing_ckpt_path(ckpt_path)) is not None:
            raise ConfigError(line)
        return str(Path(ckpt_path).resolve())
    own = Path(output_dir) / "checkpoints" / "last.ckpt"
    for candidate in (own, own.with_name("last.ckpt.old")):
        if candidate.exists():
            return str(candidate)
    if (
        partial := own.with_name("last.ckpt.partial")
    ).exists():  # its first save was cut off (checkpoint/atomic.py)
        raise ConfigError(
            f"ckpt_path=last: this run's only checkpoint is {partial}, a save that was cut off before it completed "
            "(nothing to resume); start afresh in a new hydra.run.dir, or give ckpt_path=<a whole checkpoint>"
        )
    candidates = [
        *Path(runs_root).glob("*/checkpoints/last.ckpt"),
        *Path(runs_root).glob("*/checkpoints/last.ckpt.old"),
    ]
    if not candidates:
        raise ConfigError(f"ckpt_path=last but no run under {runs_root} has a checkpoints/last.ckpt")
    newest = max(candidates, key=lambda p: p.stat().st_mtime)
    if owner := live_owner(newest.parent.parent):  # still writing it: its next save would race this run's
        raise ConfigError(
            f"ckpt_path=last is {newest}, whose run is still alive (pid {owner['pid']} on {owner['host']}); "
            "wait for it to end (or stop it: it saves last.ckpt on SIGTERM), then resume"
        )
    return str(newest)


def check_model_matches(ckpt_path: str, model: dict, strict: bool = True) -> dict:
    """The checkpoint was trained with `model`'s settings (keys `model` lacks are not compared); returns its
    client state. `strict=False` (the preflight): a checkpoint without a parallama model config passes, for
    the run's own check to word."""
    from parallama.models import DEFAULT_FAMILY, model_spec

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
    from parallama.checkpoint.untrusted import verify_checkpoint

    verify_checkpoint(ckpt_path)
    state = check_model_matches(ckpt_path, model)
    step = state.get("global_step", 0)
    if 0 < max_steps <= step:
        raise ConfigError(
            f"ckpt_path={ckpt_path} is at step {step} and trainer.max_steps={max_steps}: nothing is left to "
            f"train; raise trainer.max_steps to continue the run"
        )
    saved_data = state.get(type(datamodule).__name__)
    if saved_data:  # the data-parallel size and batch size may change: the data position is a global sample
        datamodule.check_resume(saved_data, source=f"ckpt_path={ckpt_path}")
