"""Optuna search that prunes, resumes and uses every device (`hydra/sweeper: optuna_pruning`, set by
`hparams_search=lr_optuna`).

The study lives in a database (`hydra.sweeper.storage`, SQLite by default), so running the same command again
continues it: trials that an interrupted sweep left running are marked failed and run again first with the same
parameters, from their last.ckpt (a trial whose fit had already ended keeps its value instead), and `n_trials` counts the study's finished trials, not this invocation's. Trials are asked in batches
of as many as the launcher runs at once (`hydra/launcher: devices`), each job told its trial number
(`callbacks.optuna_pruning.trial`) so it reports its validation loss to the study and stops when the pruner says so
(sweeps/pruning.py). At the end, `<sweep dir>/optimization_results.yaml` names the best trial's parameters, value,
checkpoint and directory.

Replaces hydra-optuna-sweeper (its latest, 1.3.0, still requires optuna<3 where parallama pins optuna 5; and its
trials only return a final value, so nothing prunes) with the same keys
and search-space syntax: `choice(...)`, `range(...)`, `interval(a, b)`, `tag(log, interval(a, b))`,
`tag(int, interval(a, b))`, in `params` or as sweep overrides on the command line.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from parallama.errors import ConfigError
from parallama.sweeps import jobs

log = logging.getLogger(__name__)

DIVERGED = 3  # cli/app.py's exit status for a run that diverged: a failed trial, the search goes on
TRIAL_KEY = "callbacks.optuna_pruning"


class OptunaPruningSweeper(Sweeper):
    """Optuna's ask/tell loop over Hydra's launcher, with the study in `storage`. `sampler` and `pruner` are
    configs (`_target_`), instantiated when the study is opened."""

    def __init__(
        self,
        sampler,
        direction: str = "minimize",
        study_name: str = "study",
        storage: str | None = None,
        n_trials: int = 10,
        n_jobs: int | None = None,
        pruner=None,
        params: DictConfig | None = None,
        enqueue_trials: list | None = None,
        other_settings: bool = False,
    ) -> None:
        self.sampler, self.pruner, self.direction = sampler, pruner, direction
        self.study_name, self.storage, self.n_trials, self.n_jobs = study_name, storage, n_trials, n_jobs
        self.params = OmegaConf.to_container(params, resolve=True) if params else {}
        self.enqueue_trials = OmegaConf.to_container(enqueue_trials, resolve=True) if enqueue_trials else []
        self.other_settings = other_settings  # continue a study whose trials ran under other fixed settings

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    @jobs.one_line_errors
    def sweep(self, arguments: list[str]) -> list:
        import optuna  # start-up time (optuna)

        from parallama.sweeps.pruning import sqlite_storage  # torch-free module

        optuna.logging.set_verbosity(
            optuna.logging.WARNING
        )  # its INFO lines say what this sweeper's lines say
        fixed, space = search_space(arguments, self.params)
        if self.storage is None:
            raise ConfigError("hydra.sweeper.storage is null: set a database, e.g. sqlite:///optuna.db")
        if self.storage.startswith("sqlite:///"):
            Path(self.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        storage = sqlite_storage(self.storage)
        try:  # a study continued: its sampler's seed moves on, or it would draw the first run's points again
            seen = len(
                optuna.load_study(study_name=self.study_name, storage=storage).get_trials(deepcopy=False)
            )
        except KeyError:
            seen = 0
        seed = {"seed": self.sampler.seed + seen} if self.sampler.get("seed") is not None else {}
        study = optuna.create_study(
            study_name=self.study_name,
            storage=storage,
            sampler=instantiate(self.sampler, **seed),
            pruner=instantiate(self.pruner),
            direction=self.direction,
            load_if_exists=True,
        )
        self.check_settings(study, fixed)
        self.continue_study(study)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        at_once = self.n_jobs or parallel_jobs(self.launcher, self.config)
        prunes = OmegaConf.select(self.config, TRIAL_KEY) is not None
        job_idx, returns, found = 0, [], []
        resume = jobs.resume_command(self.config)  # the study continues where it stands
        while (left := self.n_trials - finished(study)) > 0:
            trials = [study.ask(space) for _ in range(min(at_once, left))]
            overrides = []
            for trial in trials:
                job = [*fixed, *(f"{key}={value}" for key, value in trial.params.items())]
                if ckpt := trial.user_attrs.get("resume_from"):  # an interrupted trial, run again
                    job.append(f"ckpt_path='{ckpt}'")
                overrides.append([*job, f"{TRIAL_KEY}.trial={trial.number}"] if prunes else job)
            try:
                results = self.launcher.launch(overrides, initial_job_idx=job_idx)
            except jobs.SweepInterrupted as stop:  # Ctrl-C or SIGTERM: the jobs have checkpointed and ended
                jobs.end(found + jobs.outcomes(stop.results, job_idx), sweep_dir, resume, interrupted=True)
            found += jobs.outcomes(results, job_idx)
            job_idx += len(trials)
            errors = [
                err for trial, result in zip(trials, results) if (err := self.tell(study, trial, result))
            ]
            returns.append(results)
            if errors:  # a bug or a bad config, which every trial would meet alike: the search stops here
                break
        self.report(study, sweep_dir)
        jobs.end(found, sweep_dir, resume)
        return returns

    def check_settings(self, study, fixed: list[str]) -> None:
        """A study's trials are comparable only under the same fixed settings (the command line's overrides that
        are not searched): a new study records them; continuing one under others is refused in one line (found:
        the best trial was chosen across two budgets, `trainer.max_steps=10` and then `4`), unless
        `hydra.sweeper.other_settings=true` says the mix is meant (the change is then logged)."""
        settings = sorted(fixed)
        recorded = study.user_attrs.get("settings")
        if recorded is None or not study.get_trials(deepcopy=False):
            study.set_user_attr("settings", settings)
            return
        if recorded == settings:
            return
        gone, new = sorted(set(recorded) - set(settings)), sorted(set(settings) - set(recorded))
        change = f"its trials ran with {gone or 'nothing more'}, this command has {new or 'nothing more'}"
        if not self.other_settings:
            raise ConfigError(
                f"study {self.study_name!r} in {self.storage}: {change}; run it with the same settings, start "
                "another study (hydra.sweeper.study_name=...), or mix them with hydra.sweeper.other_settings=true"
            )
        log.warning(f"study {self.study_name!r} continues under other settings: {change}")
        study.set_user_attr("settings", settings)

    def continue_study(self, study) -> None:
        """Trials left running by an interrupted sweep: one whose fit had ended is told its value (or pruned);
        the others failed, and run their parameters again, first, from the trial's last.ckpt when it wrote one. A new study starts with `enqueue_trials` (settings known to be good,
        or bad, to compare against)."""
        from optuna.trial import TrialState  # start-up time (optuna)

        trials = study.get_trials(deepcopy=False)
        if not trials:
            for params in self.enqueue_trials:
                study.enqueue_trial(params)
        for trial in (t for t in trials if t.state == TrialState.RUNNING):
            pruned_at, value = trial.user_attrs.get("pruned_at_step"), trial.user_attrs.get("fit_value")
            if pruned_at is not None:  # it was pruned; the sweep stopped before its job returned
                study.tell(trial.number, state=TrialState.PRUNED)
                log.info(f"trial {trial.number} {trial.params}: pruned at step {pruned_at}")
                continue
            if value is not None:  # it trained to the end: nothing to run again
                study.tell(trial.number, value)
                log.info(f"trial {trial.number} {trial.params}: {value} (fit ended before the stop)")
                continue
            study.tell(trial.number, state=TrialState.FAIL)
            attrs = {"retry_of": trial.number}
            last = Path(trial.user_attrs.get("output_dir", "-")) / "checkpoints" / "last.ckpt"
            if last.exists():
                attrs["resume_from"] = str(last)
            study.enqueue_trial(trial.params, user_attrs=attrs)
            log.info(
                f"trial {trial.number} was interrupted: running {trial.params} again from {attrs.get('resume_from', 'the start')}"
            )
        if done := finished(study):
            log.info(f"study {self.study_name!r} continues with {done} of {self.n_trials} trials finished")

    def tell(self, study, trial, result) -> Exception | None:
        """Tell the study how the trial's job ended; a failure other than divergence is returned."""
        from optuna.trial import TrialState  # start-up time (optuna)

        if "output_dir" not in trial.user_attrs:  # set by the job's pruning callback, if it has one
            trial.set_user_attr("output_dir", str(Path(job_output_dir(result)).resolve()))
        if (err := jobs.job_error(result)) is not None:
            diverged = getattr(err, "status", None) == DIVERGED
            if diverged:
                trial.set_user_attr("diverged", True)
                log.warning(f"trial {trial.number} diverged: {err}")
            study.tell(trial, state=TrialState.FAIL)
            return None if diverged else err
        value = result.return_value
        pruned_at = study.get_trials(deepcopy=False)[trial.number].user_attrs.get("pruned_at_step")
        if pruned_at is not None:
            study.tell(trial, state=TrialState.PRUNED)
            log.info(f"trial {trial.number} {trial.params}: pruned at step {pruned_at}")
        else:
            study.tell(trial, value)
            log.info(f"trial {trial.number} {trial.params}: {value}")
        return None

    def report(self, study, sweep_dir: Path) -> None:
        from optuna.trial import TrialState  # start-up time (optuna)

        states = [t.state for t in study.get_trials(deepcopy=False)]
        counts = {s.name.lower(): states.count(s) for s in TrialState if s != TrialState.WAITING}
        results = {"study": self.study_name, "storage": self.storage, "trials": counts}
        if counts["complete"]:
            best = study.best_trial
            results.update(
                best_trial=best.number,
                best_value=best.value,
                best_params=best.params,
                best_checkpoint=best.user_attrs.get("checkpoint"),
                best_output_dir=best.user_attrs.get("output_dir"),
            )
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
        log.info(
            f"{OmegaConf.to_yaml(OmegaConf.create(results))}-> {sweep_dir / 'optimization_results.yaml'}"
        )


def finished(study) -> int:
    """Trials that count towards n_trials: completed, pruned, or failed by diverging (not interrupted)."""
    from optuna.trial import TrialState  # start-up time (optuna)

    done = (TrialState.COMPLETE, TrialState.PRUNED)
    trials = study.get_trials(deepcopy=False)
    return sum(t.state in done or t.user_attrs.get("diverged", False) for t in trials)


def search_space(arguments: list[str], params: dict) -> tuple[list[str], dict]:
    """(the overrides every trial gets, {key: optuna distribution}) from the command line and `params`."""
    parser = OverridesParser.create()
    overrides = parser.parse_overrides([*(f"{k}={v}" for k, v in params.items()), *arguments])
    last = {o.get_key_element(): o for o in overrides}  # the command line's value of a key wins
    fixed = [o.input_line for o in last.values() if not o.is_sweep_override()]
    space = {key: distribution(o) for key, o in last.items() if o.is_sweep_override()}
    if not space:
        raise ConfigError(
            "hydra.sweeper.params is empty: nothing to search (e.g. optimizer.lr: interval(1e-4,1e-2))"
        )
    return fixed, space


def distribution(override):
    """An Optuna distribution for one swept key, as hydra-optuna-sweeper read them."""
    # start-up time (optuna)
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value, key = override.value(), override.get_key_element()
    if isinstance(value, ChoiceSweep):
        return CategoricalDistribution(list(override.sweep_iterator()))
    if isinstance(value, RangeSweep):
        values = list(override.sweep_iterator())
        if all(isinstance(v, int) for v in values) and len(values) > 1:
            return IntDistribution(values[0], values[-1], step=values[1] - values[0])
        return CategoricalDistribution(values)
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return IntDistribution(int(value.start), int(value.end), log=log_scale)
        return FloatDistribution(value.start, value.end, log=log_scale)
    raise ConfigError(
        f"{key}={override.input_line.split('=', 1)[1]}: not a search space (choice, range, interval)"
    )


def parallel_jobs(launcher, config) -> int:
    """Trials to ask at once when n_jobs is not set: as many as the launcher runs at once (parallama's, by its
    devices; Hydra's submitit launcher, its array_parallelism: SLURM runs them as the cluster has room)."""
    if hasattr(launcher, "parallel_jobs"):
        return launcher.parallel_jobs()
    return int(OmegaConf.select(config, "hydra.launcher.array_parallelism", default=None) or 1)


def job_output_dir(result) -> str:
    """A job's run directory: its Hydra output dir (a submitit job's `working_dir` is the directory it was
    submitted from, since jobs do not chdir)."""
    hydra_cfg = getattr(result, "hydra_cfg", None)
    output_dir = OmegaConf.select(hydra_cfg, "hydra.runtime.output_dir") if hydra_cfg is not None else None
    return output_dir or result.working_dir
