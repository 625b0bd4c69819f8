"""docs/customize.md as written: every file it shows is written into a folder (the user's project), and every
`parallama-train` command it shows trains there, a few steps of the tiny model, with that folder on PYTHONPATH."""

from __future__ import annotations

import csv
import math
import re
import shlex
from pathlib import Path

import pytest
from conftest import TINY, run_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "customize.md"
FILE = re.compile(r"<!-- file: (\S+) -->\n```\w+\n(.*?)```", re.S)
COMMAND = re.compile(r"^(?:PYTHONPATH=\. )?parallama-train (.*)$", re.M)
QUICK = ["trainer.max_steps=3", "trainer.val_check_interval=3", "validate_before_training=false"]
QUICK += ["sample.max_new_tokens=0"]


def test_the_page_has_examples():
    text = DOC.read_text()
    assert len(FILE.findall(text)) >= 7 and len(COMMAND.findall(text)) >= 8


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("my_project")
    for name, body in FILE.findall(DOC.read_text()):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(body)
    return folder


@pytest.mark.parametrize("command", COMMAND.findall(DOC.read_text()))
def test_each_command_of_the_page_trains(command, project, data_cache):
    run = project / "runs" / re.sub(r"\W+", "_", command)[:80]
    args = shlex.split(command)
    flags = args[:2] if args[0] == "--config-dir" else []  # Hydra's flags come before the overrides
    overrides = [*TINY, f"paths.cache_dir={data_cache}", f"hydra.run.dir={run}", *args[len(flags) :], *QUICK]
    run_cli("parallama.cli.train", *flags, *overrides, cwd=project, env={"PYTHONPATH": str(project)})
    with open(run / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    if "grad_norm" in command or "my_recipe" in command:  # the callback's metric reached the logger
        assert any(r.get("train/grad_norm") for r in rows)
    if "Accuracy" in command:  # the validation metric: a fraction of the labelled tokens
        assert 0 <= float(next(r["val/accuracy"] for r in rows if r.get("val/accuracy"))) <= 1
