"""The errors a user can act on, and how each is told: one line and an exit status (`exit_status`), the same in
every tool (cli/app.py) and in a sweep's jobs; anything else is a bug and keeps its traceback."""

from __future__ import annotations

import sys

EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_RANK_DIED = 2, 3, 4  # 0 for a preempted job


class ConfigError(ValueError):
    """Bad user input (a config key, a file, a checkpoint). The message names it and says what is valid."""


class TrainingDiverged(FloatingPointError):
    """The loss became NaN/inf; raised before the optimizer step so the last checkpoint stays good."""


class RankDied(RuntimeError):
    """Another rank of the run is gone; the message is the one line that names it (`lost_rank`)."""


class Preempted(Exception):
    """Raised on every rank at the same optimizer step, once last.ckpt is saved: the run ends with 0, its last
    line `line`. `resume`: the overrides that resume it (none for a requeued SLURM job, which resumes itself).
    `said`: that line is logged already (a requeued SLURM job's rank 0: SLURM ends the job, SIGTERM then SIGKILL,
    while its ranks wind down)."""

    def __init__(self, message: str, resume: str | None = None, said: bool = False):
        super().__init__(message)
        self.resume, self.said = resume, said

    @property
    def line(self) -> str:
        return f"{self}; resume with {self.resume}" if self.resume else str(self)


def exit_status(err: BaseException) -> tuple[int | None, str]:
    """(status, line) for an error the user can act on; (None, "") for anything else."""
    import hydra  # start-up time (hydra)

    if isinstance(err, (ConfigError, FileNotFoundError)):
        return EXIT_BAD_INPUT, f"error: {one_line(str(err))}"
    if _is_lightning_misconfiguration(err):  # Lightning's own one-line complaints about Trainer settings
        return EXIT_BAD_INPUT, f"error: {' '.join(str(err).split())}"
    if isinstance(err, hydra.errors.InstantiationException):
        return EXIT_BAD_INPUT, f"error: {instantiation_error(err)}"
    if isinstance(err, TrainingDiverged):
        return EXIT_DIVERGED, f"error: {err}"
    if isinstance(err, Preempted):
        return 0, err.line
    if isinstance(err, RankDied):
        return EXIT_RANK_DIED, str(err)
    return None, ""


def one_line(text: str) -> str:
    """`text` on one line: a message built from another error's may hold its newlines."""
    return " ".join(text.split()) if "\n" in text else text


def _is_lightning_misconfiguration(err: BaseException) -> bool:
    if "lightning" not in sys.modules:  # not loaded: the error cannot be Lightning's
        return False
    from lightning.fabric.utilities.exceptions import MisconfigurationException  # torch-free module

    return isinstance(err, MisconfigurationException)


def instantiation_error(err: Exception) -> str:
    """A constructor's complaint in one line: the project's own ConfigError as it is, anything else with the
    config key whose `_target_` raised it."""
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
        if isinstance(cause, (ConfigError, FileNotFoundError)):
            return str(cause)
    lines = str(err).splitlines()
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None)
    reason = (
        str(cause).strip().splitlines()[0] if cause is not err else (lines[1] if len(lines) > 1 else lines[0])
    )
    return f"{key or lines[0]}: {reason}"
