"""docs/customize.md as written: every file it shows is written into a folder (the user's project), and every
`parallama-train` command it shows trains there, a few steps of the tiny model, with that folder on PYTHONPATH;
a command the page follows with `# error: ...` is refused with that line (each rank's), exit status 2, before
anything is written."""

from __future__ import annotations

import csv
import math
import re
import shlex
from pathlib import Path

import pytest
from conftest import TINY, one_cycle_rates, run_cli

DOC = Path(__file__).resolve().parents[2] / "docs" / "customize.md"
FILE = re.compile(r"<!-- file: (\S+) -->\n```\w+\n(.*?)```", re.S)
# a command, and the line the page says it is refused with (none: it trains)
COMMAND = re.compile(r"^(?:PYTHONPATH=\. )?parallama-(train|export) (.*)\n(?:# (error: .*)\n)?", re.M)
QUICK = [
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
]  # validation before training and the sample stay
TOOLS = {"train": "parallama.cli.train", "export": "parallama.cli.export"}
TRAINS = [args for tool, args, error in COMMAND.findall(DOC.read_text()) if tool == "train" and not error]
REFUSED = [(tool, args, error) for tool, args, error in COMMAND.findall(DOC.read_text()) if error]


def test_the_page_has_examples():
    text = DOC.read_text()
    assert len(FILE.findall(text)) >= 14 and len(TRAINS) >= 13 and len(REFUSED) >= 3


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("my_project")
    for name, body in FILE.findall(DOC.read_text()):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(body)
    return folder


def run_page(tool: str, command: str, project: Path, data_cache: Path, check: bool = True):
    """A command of the page in the user's project; a training run gets the tiny model and a few steps, in the
    run directory the command names (else one of its own), and returns that directory."""
    args = shlex.split(command)
    flags = args[:2] if args[0] == "--config-dir" else []  # Hydra's flags come before the overrides
    if tool == "export":
        return run_cli(TOOLS[tool], *args, cwd=project, env={"PYTHONPATH": str(project)}, check=check), None
    named = [a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")]
    run = project / (named[0] if named else Path("runs") / re.sub(r"\W+", "_", command)[:80])
    overrides = [*TINY, f"paths.cache_dir={data_cache}", *args[len(flags) :], *QUICK]
    overrides += [] if named else [f"hydra.run.dir={run}"]
    proc = run_cli(
        TOOLS[tool], *flags, *overrides, cwd=project, env={"PYTHONPATH": str(project)}, check=check
    )
    return proc, run


@pytest.mark.parametrize("command", TRAINS)
def test_each_command_of_the_page_trains(command, project, data_cache):
    _, run = run_page("train", command, project, data_cache)
    with open(run / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    if "grad_norm" in command or "my_recipe" in command:  # the callback's metric reached the logger
        assert any(r.get("train/grad_norm") for r in rows)
    if "Accuracy" in command:  # the validation metric: a fraction of the labelled tokens
        assert 0 <= float(next(r["val/accuracy"] for r in rows if r.get("val/accuracy"))) <= 1
    if "MaxLoss" in command:  # the training metric on each logged step: of one step, one rank: its loss
        logged = [(r["train/loss"], r.get("train/max_loss")) for r in rows if r.get("train/loss")]
        assert all(max_loss and float(max_loss) == pytest.approx(float(loss)) for loss, max_loss in logged)
    if "OneCycleLR" in command:  # the rate each step used: torch's OneCycleLR over the run's 3 steps
        rates = [float(r["lr-AdamW/pg1"]) for r in rows if r.get("lr-AdamW/pg1")]
        assert rates == pytest.approx(one_cycle_rates(3, max_lr=1e-2), rel=1e-6)


@pytest.mark.parametrize("tool, command, error", REFUSED, ids=[f"{t} {c}" for t, c, _ in REFUSED])
def test_each_refusal_of_the_page_is_its_one_line(tool, command, error, project, data_cache):
    for ckpt in re.findall(r"ckpt_path=(runs/[^/]+)/", command):  # the page's run that wrote it
        if not (project / ckpt / "checkpoints" / "last.ckpt").exists():
            run_page("train", next(c for c in TRAINS if f"hydra.run.dir={ckpt}" in c), project, data_cache)
    proc, run = run_page(tool, command, project, data_cache, check=False)
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if "error:" in line]
    assert proc.returncode == 2 and lines, out[-3000:]
    layers = re.compile(r"\(and \d+ more\)")  # the tiny model here has 2 blocks, the page's default 4
    for line in lines:  # each rank's one line
        assert layers.sub("", line[line.index("error:") :]).startswith(layers.sub("", error)), lines
    assert not (run and (run / "checkpoints").exists()) and not (project / "hf").exists()  # nothing written


def test_a_metric_of_yours_survives_a_validation_before_training_in_inference_mode(project, data_cache):
    """With trainer.inference_mode=true the validation before training runs in inference mode, where the metric's
    reset leaves inference tensors; CausalLM resets every metric when fit starts, so fit's updates work."""
    command = next(c for c in TRAINS if "Accuracy" in c) + " trainer.inference_mode=true"
    _, run = run_page("train", command, project, data_cache)
    with open(run / "csv" / "metrics.csv") as f:
        assert [r["val/accuracy"] for r in csv.DictReader(f) if r.get("val/accuracy")]
