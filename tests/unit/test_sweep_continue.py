"""What a continued study does with the trials an interrupted sweep left running (a real SQLite study)."""

from __future__ import annotations

import optuna
from omegaconf import OmegaConf
from optuna.trial import TrialState

from parallama.sweeps.optuna_sweeper import OptunaPruningSweeper, finished


def test_trials_left_running_are_scored_pruned_or_run_again(tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="lr", storage=storage)
    space = {"optimizer.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)}
    ended, pruned, cut, fresh = (study.ask(space) for _ in range(4))
    ended.set_user_attr("fit_value", 3.5)  # its fit ended; the sweep was stopped before the job returned
    pruned.set_user_attr("pruned_at_step", 2)
    run_dir = tmp_path / "job"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    cut.set_user_attr("output_dir", str(run_dir))  # stopped mid-training, after its last.ckpt
    sweeper = OptunaPruningSweeper(sampler=OmegaConf.create({}), study_name="lr", storage=storage, n_trials=4)

    sweeper.continue_study(study)

    trials = study.get_trials()
    assert [t.state for t in trials[:4]] == [
        TrialState.COMPLETE,
        TrialState.PRUNED,
        TrialState.FAIL,
        TrialState.FAIL,
    ]
    assert trials[0].value == 3.5 and finished(study) == 2
    retries = [t for t in trials[4:] if t.state == TrialState.WAITING]
    assert [t.user_attrs["retry_of"] for t in retries] == [2, 3]
    assert [t.system_attrs["fixed_params"] for t in retries] == [cut.params, fresh.params]  # asked first
    assert retries[0].user_attrs["resume_from"] == str(run_dir / "checkpoints" / "last.ckpt")
    assert "resume_from" not in retries[1].user_attrs  # it wrote no checkpoint: from the start


def test_a_study_continued_under_other_settings_is_refused_unless_asked(tmp_path, caplog):
    """Found: `n_trials=2 trainer.max_steps=10`, then `n_trials=3 trainer.max_steps=4` continued the study and
    chose the best trial across both budgets. The fixed overrides are recorded with the study; other ones are
    one line, unless hydra.sweeper.other_settings=true (said in the log)."""
    import pytest

    from parallama.errors import ConfigError

    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="lr", storage=storage)
    sweeper = OptunaPruningSweeper(sampler=OmegaConf.create({}), study_name="lr", storage=storage)
    first = ["trainer.max_steps=10", "model.hidden_size=64"]
    sweeper.check_settings(study, first)  # a new study records them
    study.ask({"optimizer.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)})
    sweeper.check_settings(study, list(reversed(first)))  # the same settings in another order
    with pytest.raises(ConfigError) as err:
        sweeper.check_settings(study, ["trainer.max_steps=4", "model.hidden_size=64"])
    message = str(err.value)
    assert "its trials ran with ['trainer.max_steps=10'], this command has ['trainer.max_steps=4']" in message
    assert "hydra.sweeper.other_settings=true" in message and "\n" not in message
    sweeper.other_settings = True
    sweeper.check_settings(study, ["trainer.max_steps=4", "model.hidden_size=64"])
    assert study.user_attrs["settings"] == ["model.hidden_size=64", "trainer.max_steps=4"]
