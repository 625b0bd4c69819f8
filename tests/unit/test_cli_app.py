"""cli/app.py's front door hands Hydra the mode its preflight found (`_mode_known`): a run composes its config
twice (the preflight's check, Hydra's run), not three times, and the job Hydra runs is the same as without the
shortcut (its mode, the overrides Hydra records)."""

from __future__ import annotations

import contextlib

import pytest
from hydra._internal.hydra import Hydra
from hydra.core.hydra_config import HydraConfig

from parallama.cli import app
from parallama.runtime.launch import CHECKED_ENV


def run(tmp_path, monkeypatch, *args: str, shortcut: bool = True) -> tuple[int, dict]:
    """Run a do-nothing task through the front door: (compositions, what the job's HydraConfig says)."""
    compositions, seen = [0], {}
    compose_config = Hydra.compose_config

    def counted(self, *a, **k):
        compositions[0] += 1
        return compose_config(self, *a, **k)

    def task(cfg) -> None:
        hc = HydraConfig.get()
        seen.update(mode=hc.mode, hydra_overrides=list(hc.overrides.hydra), task=list(hc.overrides.task))

    monkeypatch.setattr(Hydra, "compose_config", counted)
    if not shortcut:
        monkeypatch.setattr(app, "_mode_known", lambda mode: contextlib.nullcontext())
    app.run("train", task, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.accelerator=cpu", *args])
    return compositions[0], seen


@pytest.mark.parametrize(
    "args",
    [[], ["hydra.mode=RUN"]],
    ids=["mode-unset", "mode-given"],
)
def test_a_run_composes_twice_and_runs_the_job_hydra_would(tmp_path, monkeypatch, args):
    fast = run(tmp_path / "fast", monkeypatch, *args)
    monkeypatch.undo()
    plain = run(tmp_path / "plain", monkeypatch, *args, shortcut=False)
    assert (fast[0], plain[0]) == (2, 3)
    for seen in (fast[1], plain[1]):  # the run dir differs
        seen["hydra_overrides"] = [o for o in seen["hydra_overrides"] if not o.startswith("hydra.run.dir=")]
    assert fast[1] == plain[1] and str(fast[1]["mode"]) == "RunMode.RUN"


def test_with_one_of_hydras_own_groups_chosen_hydra_reads_the_mode_itself(tmp_path, monkeypatch):
    """The preflight does not compose Hydra's groups (`hydra/job_logging=...`), one of which might set the mode."""
    compositions, seen = run(tmp_path, monkeypatch, "hydra/hydra_logging=disabled")
    assert compositions == 3 and str(seen["mode"]) == "RunMode.RUN"


def test_a_rank_started_by_its_run_composes_once(tmp_path, monkeypatch):
    """The ranks a run starts itself are not checked again (`CHECKED_ENV`) and run with hydra.mode=RUN last."""
    monkeypatch.setenv(CHECKED_ENV, "1")
    fast = run(tmp_path / "fast", monkeypatch, "hydra.mode=RUN", "hydra.job.name=train_ddp_process_1")
    assert fast[0] == 1 and str(fast[1]["mode"]) == "RunMode.RUN"
