"""Callbacks that need to know parallama's batch layout (stopping on a signal: preemption.py). Everything else in
conf/callbacks is Lightning's own."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.callbacks import RichModelSummary as LightningRichModelSummary
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_summary.model_summary import (
    get_formatted_model_size,
    get_human_readable_count,
)
from rich import get_console
from rich.table import Table

from parallama.distributed.float8 import precompute_scales
from parallama.training import syncs
from parallama.training.module import ends_the_run

# Saved run configs name `parallama.training.callbacks.PreemptionCheckpoint` (conf/callbacks/default.yaml did before
# it moved to preemption.py): an alias, so they still build
from parallama.training.preemption import PreemptionCheckpoint  # noqa: F401

log = logging.getLogger("parallama")


class AtLeastOneValBatch(Callback):
    """`trainer.limit_val_batches` as a fraction validates at least one batch, as a fraction means in
    lightning-hydra-template's configs (0.1 of a small validation split): Lightning refuses a fraction that
    selects no batch (0.1 x 3 batches < 1). Set when the data module is set up, before Lightning counts the
    batches. Test: tests/integration/test_lht_port.py (LHT's own `limit_val_batches=0.1`)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        limit, data = trainer.limit_val_batches, trainer.datamodule
        if not (isinstance(limit, float) and 0 < limit < 1) or data is None:
            return
        batches = len(data.val_dataloader())
        if batches and int(batches * limit) == 0:
            log.info(f"trainer.limit_val_batches={limit} of {batches} validation batches: validating 1 batch")
            trainer.limit_val_batches = 1


class StepNumbers(Callback):
    """Every logger numbers a row by the optimizer steps taken before it was logged ("step N = after N
    optimizer steps"), as the console lines and checkpoint names (step0000500.ckpt) do.

    Lightning numbers the rows of `self.log` by its count of optimizer steps as it stood before the step that
    logged them (step 100's loss and the validation after it were row 99). Lightning takes a logged `step`
    metric as the row's step (LoggerConnector.log_metrics), so this logs the optimizer steps as `step`
    wherever the module logs: after each training batch and at the end of each validation. A CPU tensor: a
    Python number would become a tensor on the GPU, which waits for it (training/syncs.py). The rows that
    callbacks write themselves (training/monitors.py: tokens/s, learning rates) use the same numbering.
    Test: tests/integration/test_cli.py::test_console_csv_and_checkpoint_names_number_steps_alike."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("step", torch.tensor(float(trainer.global_step)))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("step", torch.tensor(float(trainer.global_step)))


class RichModelSummary(LightningRichModelSummary):
    """Lightning's RichModelSummary without its FLOPs column and "Total FLOPs" line, its counts on one line.
    Lightning counts FLOPs only by running the module's `example_input_array`, which a CausalLM has none of (a
    forward of the whole model at fit start), so they read 0. The model's FLOPs per token are in the loggers'
    hyper-parameters (`model/flops_per_token`) and the TokenThroughputMonitor's FLOP/s. Kept for
    tests/integration/test_cli.py::test_a_run_prints_no_known_noise and ::test_a_default_run_prints_at_most_40_lines."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs,
    ) -> None:
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            style = {" ": "dim", "In sizes": "white", "Out sizes": "white"}.get(name)
            right = name not in (" ", "Name", "Type", "Mode")
            table.add_column(name, justify="right" if right else "left", style=style, no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        untrainable = total_parameters - trainable_parameters
        console.print(  # one line, not Lightning's six (its count of modules in train and eval mode says nothing)
            f"[bold]Trainable params[/]: {get_human_readable_count(int(trainable_parameters)).strip()}, "
            f"non-trainable: {get_human_readable_count(int(untrainable)).strip()}, "
            f"total: {get_human_readable_count(int(total_parameters)).strip()}"
            f" ({get_formatted_model_size(model_size)} MB)",
            soft_wrap=True,
        )


class LastCheckpoint(Checkpoint):
    """`last.ckpt` every N optimizer steps and/or every T, and always after the run's last step (the resume point,
    whatever validation does; Lightning's ModelCheckpoint takes N or T, not both).

    The last step is saved from the step itself, like the periodic saves, and not after the loop ends: by then
    Lightning has counted the epoch as finished, so extending the run (a higher max_steps) would skip the rest
    of the epoch. Like ModelCheckpoint it writes nothing under fast_dev_run or outside `fit`, and a step once.
    Tests: tests/unit/test_training_callbacks.py::test_last_checkpoint_is_written_every_n_steps_and_or_every_t_and_at_the_end,
    tests/integration/test_cli.py::test_last_checkpoint_every_n_steps_and_every_t.
    """

    def __init__(
        self,
        dirpath: str,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        filename: str = "last",
    ) -> None:
        self.path = str(Path(dirpath) / f"{filename}.ckpt")
        self.every_n_train_steps = every_n_train_steps
        self.time_interval = train_time_interval
        self.saved_step: int | None = None  # the step of the last save (None: none yet)
        self._started_at_step: int | None = (
            None  # nothing to save before a step (a resume's is saved already)
        )
        self._last_saved_at = time.monotonic()

    def on_train_start(self, trainer, pl_module) -> None:
        self._started_at_step, self._last_saved_at = trainer.global_step, time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self._may_save(trainer):
            return
        n = self.every_n_train_steps
        due = bool(n) and trainer.global_step % n == 0
        if self.time_interval is not None and self._ask_clock(trainer):
            late = time.monotonic() - self._last_saved_at >= self.time_interval.total_seconds()
            due = trainer.strategy.broadcast(late) or due  # rank 0's clock decides, so that every rank saves
        if due or ends_the_run(trainer):
            self._save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._may_save(trainer):  # e.g. stopped early by a callback
            self._save(trainer)

    @staticmethod
    def _ask_clock(trainer) -> bool:
        """Whether this step asks rank 0's clock: every step in one process (free), else on logging steps where
        a broadcast would wait for the GPU (as `PreemptionCheckpoint` agrees on a signal), every step on CPU."""
        if trainer.world_size == 1 or not syncs.device_waits(trainer):
            return True
        return trainer.global_step % max(trainer.log_every_n_steps, 1) == 0

    def _may_save(self, trainer) -> bool:
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        new_step = trainer.global_step not in (self.saved_step, self._started_at_step)
        return fitting and not trainer.fast_dev_run and new_step

    def _save(self, trainer) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)  # a full one: it resumes
        self.saved_step, self._last_saved_at = trainer.global_step, time.monotonic()


class ValidationTokens(Callback):
    """Counts the labelled tokens a validation saw (parallama-eval prints them beside their mean loss)."""

    def __init__(self) -> None:
        self.count = 0

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        self.count += int((batch["labels"] != -100).sum())


class Float8Scales(Callback):
    """float8 under FSDP2's float8 all-gather (distributed/float8.py): after each optimizer step, the weights' scales
    for the next all-gather, computed at once (torchtitan's `precompute_float8_dynamic_scale_for_fsdp`); a no-op
    for a model without such weights. parallama-train adds it when `float8` is set."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        precompute_scales(pl_module.model)
