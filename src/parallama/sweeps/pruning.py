"""A trial of an Optuna sweep reports its validation metric to the study as it trains, and stops when the study's
pruner says the trial is not worth finishing (`callbacks.optuna_pruning`, added by the hparams_search presets).

Why not `optuna_integration.PyTorchLightningPruningCallback` (optuna-integration 5.0, which does import
`lightning.pytorch`): it reports at `step=current_epoch`, and a pretraining run validates every
`val_check_interval` steps inside one epoch, so every report after the first lands on step 0 and Optuna drops
it (the untrained model's loss from `validate_before_training` would be the only value); a single-process trial
is stopped by raising `TrialPruned` out of `fit()` (no last checkpoint, loggers not closed); and every rank needs
a `Trial` backed by the database. This callback reports at `global_step`, only rank 0 talks to the study, the
decision is broadcast to every rank (a rank left out would wait in the next collective forever), and a pruned
trial ends as a finished run (last.ckpt written, loggers closed), its sweeper told through the trial's
`pruned_at_step` attribute.
"""

from __future__ import annotations

import logging
from pathlib import Path

from lightning.pytorch.callbacks import Callback

log = logging.getLogger("parallama")


def sqlite_storage(url: str):
    """The study's database, waiting on a lock instead of failing while other trials write to SQLite."""
    import optuna  # start-up time (optuna)

    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


class OptunaPruning(Callback):
    """Reports `monitor` at each validation of `fit` (step = optimizer steps) to trial number `trial` of the
    study, and stops training on every rank when the pruner prunes. `trial: null` (a run outside a sweep): off."""

    def __init__(
        self, monitor: str, storage: str, study_name: str, pruner=None, trial: int | None = None
    ) -> None:
        self.monitor, self.storage, self.study_name = monitor, storage, study_name
        self.pruner, self.trial_number = pruner, trial
        self._trial = None

    def trial(self):
        """The running trial, from the study's database (rank 0 only)."""
        if self._trial is None:
            import optuna  # start-up time (optuna)

            storage = sqlite_storage(self.storage)
            study = optuna.load_study(study_name=self.study_name, storage=storage, pruner=self.pruner)
            study_id = storage.get_study_id_from_name(self.study_name)
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, self.trial_number)
            self._trial = optuna.trial.Trial(study, trial_id)
        return self._trial

    def on_fit_start(self, trainer, pl_module) -> None:
        """Where the trial's run lives: a sweep interrupted mid-trial runs it again from its last.ckpt."""
        if self.trial_number is not None and trainer.is_global_zero:
            self.trial().set_user_attr("output_dir", str(Path(trainer.default_root_dir).resolve()))

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.trial_number is None or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        step = trainer.global_step
        prune = False
        if trainer.is_global_zero:
            value = trainer.callback_metrics.get(self.monitor)
            if value is None:
                raise KeyError(
                    f"callbacks.optuna_pruning.monitor={self.monitor} was not logged at validation"
                )
            trial = self.trial()
            trial.report(float(value), step)
            prune = trial.should_prune()
            if prune:
                trial.set_user_attr("pruned_at_step", step)
                log.info(
                    f"trial {self.trial_number} pruned at step {step} ({self.monitor} {float(value):.4f})"
                )
        if trainer.strategy.broadcast(prune, src=0):
            trainer.should_stop = True

    def on_fit_end(self, trainer, pl_module) -> None:
        """Where the sweeper finds the trial's checkpoint (the best by val/loss, else the last), and the value the
        job will return: a sweep stopped between the end of fit and the job's exit still scores the trial."""
        if self.trial_number is None or not trainer.is_global_zero:
            return
        from parallama.training.callbacks import LastCheckpoint  # start-up time (hydra)

        if (value := trainer.callback_metrics.get(self.monitor)) is not None:
            self.trial().set_user_attr("fit_value", float(value))

        paths = [getattr(c, "best_model_path", "") for c in trainer.checkpoint_callbacks]
        paths += [
            c.path
            for c in trainer.checkpoint_callbacks
            if isinstance(c, LastCheckpoint) and c.saved_step is not None
        ]
        if checkpoint := next((p for p in paths if p), None):
            self.trial().set_user_attr("checkpoint", str(Path(checkpoint).resolve()))
