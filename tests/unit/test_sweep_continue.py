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
