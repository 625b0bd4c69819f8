"""Third-party warnings and log lines that ask nothing of the user, silenced by exact message (issue 39: quiet,
useful logs), wherever parallama's processes start."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_known_warnings() -> None:
    """Warnings about code that is not parallama's and that a user cannot act on, filtered exactly: in this process
    (the command line calls it first), in each rank a strategy starts (`Parallelism.setup_environment`), and, for
    the warnings a spawned rank gives before that, through PYTHONWARNINGS, which every child process reads."""
    # lightning/pytorch/utilities/_pytree.py (_tree_flatten) builds torch's LeafSpec(), which torch 2.13 marks
    # deprecated (a FutureWarning from torch/utils/_pytree.py, attributed to Lightning's line): every run warned.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )
    # Lightning's SLURMEnvironment.detect() warns wherever `srun` is installed but did not start the process (a
    # SLURM login node, a machine with slurm-wlm): parallama starts one node's ranks itself, and a multi-node run
    # without a launcher is refused in one line that names srun (runtime/faults.py), so the hint never applies.
    warnings.filterwarnings(
        "ignore", message=r"The `srun` command is available on your system but is not used"
    )
    _inherit("The `srun` command is available on your system but is not used")
    # parallama logs val/loss, val/ppl and step once computed over every rank (torchmetrics syncs the loss), so
    # Lightning's advice to sync them again (`sync_dist=True`, once per key and multi-rank run) does not apply.
    warnings.filterwarnings(
        "ignore",
        message=r"It is recommended to use `self\.log\('(val/loss|val/ppl|step)', \.\.\., sync_dist=True\)`",
    )
    for key in ("val/loss", "val/ppl", "step"):
        _inherit(f"It is recommended to use `self.log('{key}'")
    # torch 2.13 deprecates `all_gather_into_tensor` and still calls it itself (FSDP2's and DTensor's all-gathers),
    # once per rank of a sharded run: parallama never calls it.
    deprecated_gather = "`torch.distributed.all_gather_into_tensor` is deprecated"
    warnings.filterwarnings("ignore", message=deprecated_gather.replace(".", r"\."), category=FutureWarning)
    _inherit(deprecated_gather)
    # Lightning's INFO lines about its own set-up that ask nothing of the user: an advertisement for its cloud logger,
    # and that the model summary callback parallama configures is configured.
    lightning = "lightning.pytorch.utilities.rank_zero"
    drop_log_records(lightning, "try installing [litlogger]")
    drop_log_records(lightning, "Trainer already configured with model summary callbacks")
    # torch's DTensor, once per rank under expert parallelism: the gradient norm's partial sums over the expert and
    # data-parallel mesh dimensions are all-reduced one dimension after the other (a norm, not the step's data).
    drop_log_records("torch.distributed.tensor._redistribute", "_NormPartial", "sequential all_reduce")


class _DropRecords(logging.Filter):
    def __init__(self, needles: tuple[str, ...]) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(needle in message for needle in self.needles)


def drop_log_records(logger: str, *needles: str) -> None:
    """A third-party logger's records that contain every one of `needles` are not emitted."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, _DropRecords) and f.needles == needles for f in target.filters):
        target.addFilter(_DropRecords(needles))


def _inherit(prefix: str) -> None:
    """Child processes ignore warnings that start with `prefix` (PYTHONWARNINGS: a message's literal start, no
    commas)."""
    entry = f"ignore:{prefix}"
    entries = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    if entry not in entries:
        os.environ["PYTHONWARNINGS"] = ",".join([*entries, entry])
