"""How a sweep ends, whatever ended it: a table of its jobs' final metrics and run directories (printed, and
written as `sweep_results.csv` in the sweep directory), then, where a job did not finish, one line per job (done;
failed, with its error and where its log is; stopped, with the command that resumes the sweep) and exit status 2.
Hydra's own ending was a traceback (`Error executing job`, `KeyboardInterrupt`) and exit status 1.

Used by both sweepers (grid.py, optuna_sweeper.py), whatever their launcher: parallama's own (launcher.py), whose
jobs' failures carry how each ended, or Hydra's submitit launcher (launcher=slurm), whose jobs hand the sweep
their one line (runtime/launch.py `SweepJobEnded`).
"""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from parallama.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, exit_status
from parallama.training.report import final_metrics

DONE, DIVERGED, FAILED, STOPPED = "done", "diverged", "failed", "stopped"  # diverged: a result of the search
RESULTS = "sweep_results.csv"


class JobEnded(RuntimeError):
    """A sweep job that ended without a result: `state` failed or stopped, `status` its exit status (a negative
    one: the signal that killed it), `detail` what it said (its error line, where it stopped)."""

    def __init__(self, state: str, status: int | None, detail: str) -> None:
        super().__init__(detail)
        self.state, self.status, self.detail = state, status, detail


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM to the sweep: the jobs under way were stopped (each saved last.ckpt) and waited for;
    `results` holds every job of the launch, those never started among them."""

    def __init__(self, signal_name: str, results: Sequence[JobReturn]) -> None:
        super().__init__(signal_name)
        self.signal_name, self.results = signal_name, list(results)


@dataclass
class Outcome:
    number: int
    overrides: list[str]
    state: str
    run_dir: str
    detail: str = ""
    metrics: dict = field(default_factory=dict)


def outcomes(results: Sequence[JobReturn], first_number: int) -> list[Outcome]:
    """How each job of a launch ended, numbered from `first_number` as the launcher numbered them."""

    found = []
    for number, result in enumerate(results, first_number):
        run_dir = _run_dir(result)
        state, detail = DONE, ""
        err = job_error(result)
        if isinstance(err, JobEnded):
            state, detail = (DIVERGED if err.status == EXIT_DIVERGED else err.state), err.detail
        elif err is not None:  # a launcher's own report (submitit: the job's SweepJobEnded, or a traceback)
            status = getattr(err, "status", None)
            state = {0: STOPPED, EXIT_DIVERGED: DIVERGED}.get(status, FAILED)
            detail = getattr(err, "what", None) or " ".join(str(err).split()).removeprefix("error: ")
        metrics = (final_metrics(run_dir) or {}) if run_dir else {}
        found.append(Outcome(number, list(result.overrides or []), state, run_dir, detail, metrics))
    return found


def job_error(result: JobReturn) -> Exception | None:
    """The error a failed job's result holds (None: it completed). Hydra's `return_value` raises it, after
    writing `Error executing job with overrides: [...]` to stderr, which the sweep's own lines replace."""
    if result.status == JobStatus.COMPLETED:
        return None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            result.return_value  # noqa: B018
    except Exception as err:
        return err
    return None


def _run_dir(result: JobReturn) -> str:
    """A job's run directory, absolute: its Hydra output dir (a submitit job's `working_dir` is the directory
    it was submitted from, since jobs do not chdir)."""

    hydra_cfg = getattr(result, "hydra_cfg", None)
    output_dir = OmegaConf.select(hydra_cfg, "hydra.runtime.output_dir") if hydra_cfg is not None else None
    where = output_dir or result.working_dir
    return os.path.abspath(where) if where else ""


def end(found: list[Outcome], sweep_dir: Path, resume: str, interrupted: bool = False) -> None:
    """The sweep's last words: the table (and its CSV); where a job did not finish (or the sweep was
    `interrupted`), a line per job and exit status 2. `resume`: the command that resumes the sweep."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    columns, rows = table(found)
    with open(sweep_dir / RESULTS, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        writer.writerows(rows)
    shown = [c for c in columns if not c.startswith(("train/", "lr-", "step")) or c == "train/loss"]
    keep = [columns.index(c) for c in shown]
    lines = [[str(c) for c in shown], *([_short(row[i]) for i in keep] for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(shown))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    print(f"results: {sweep_dir / RESULTS}", flush=True)
    if not interrupted and all(o.state in (DONE, DIVERGED) for o in found):
        return
    for o in found:
        print(job_line(o, resume), file=sys.stderr)
    sys.stderr.flush()
    raise SystemExit(EXIT_BAD_INPUT)


def table(found: list[Outcome]) -> tuple[list[str], list[list]]:
    """(columns, rows): each job's number, state, the overrides that differ between jobs, its final metrics (the
    validation ones first) and run directory."""
    values = [dict(o.split("=", 1) for o in outcome.overrides if "=" in o) for outcome in found]
    keys = list(dict.fromkeys(key for job in values for key in job))
    swept = [key for key in keys if len({job.get(key) for job in values}) > 1]
    names = sorted({name for o in found for name in o.metrics}, key=lambda n: (not n.startswith("val/"), n))
    rows = [
        [
            o.number,
            o.state,
            *(job.get(key, "") for key in swept),
            *(o.metrics.get(n, "") for n in names),
            o.run_dir,
        ]
        for o, job in zip(found, values)
    ]
    return ["job", "state", *swept, *names, "run_dir"], rows


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def job_line(o: Outcome, resume: str) -> str:
    """One line: what the job was (its swept values), how it ended, and what to do."""
    what = f"#{o.number}"
    if o.state == DONE:
        metric = next(
            (f" ({name} {value:.4g})" for name, value in o.metrics.items() if name.startswith("val/")), ""
        )
        return f"{what} done{metric}: {o.run_dir}"
    if o.state in (FAILED, DIVERGED):
        return f"{what} {o.state}: {o.detail}"
    return f"{what} stopped: {o.detail}; resume the sweep with: {resume}"


def resume_command(config: DictConfig, *extra: str) -> str:
    """parallama-train and the sweep's own overrides (its task's and Hydra's), then `extra` in place of the ones
    they name (hydra.sweep.dir=..., ckpt_path=last)."""
    hydra = config.hydra
    named = {arg.split("=", 1)[0] for arg in extra}
    keep = [
        o
        for o in [*hydra.overrides.task, *hydra.overrides.hydra]
        if o.split("=", 1)[0].lstrip("+~") not in named
    ]
    keep = [o for o in keep if not o.startswith("hydra.mode=")]
    return shlex.join(["parallama-train", "-m", *keep, *extra])


def one_line_errors(sweep):
    """A sweeper's `sweep` whose bad input (a changed Optuna search on an existing study, a job that needs more
    devices than the sweep has) ends the sweep with its one line and exit status 2, not Hydra's traceback."""

    @functools.wraps(sweep)
    def wrapper(self, arguments):
        try:
            return sweep(self, arguments)
        except Exception as err:
            status, line = exit_status(err)
            if status is None:
                raise
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(status) from None

    return wrapper
