"""What a training job tells its user about its config: the overrides on the console, the whole config in the run
directory, and printed in full with `print_config=true`."""

from __future__ import annotations

import yaml

from parallama.cli.app import compose
from parallama.training.report import print_config


def test_print_config_true_prints_the_whole_config_uncut(tmp_path, capsys):
    """In a log file (stdout not a terminal) no line is cut at 80 columns: here the run directory's is longer."""
    run = tmp_path / ("a-directory-name-long-enough-to-pass-eighty-columns-" * 2)
    cfg = compose("train", [f"hydra.run.dir={run}", "print_config=true", "trainer.max_steps=7"])
    print_config(cfg)
    printed = capsys.readouterr().out
    assert f"output_dir: {run}\n" in printed
    assert yaml.safe_load(printed) == yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert yaml.safe_load(printed)["trainer"]["max_steps"] == 7
