"""Bad config input on the real command line: the one `error:` line and exit status 2 are all the user sees
(the cases themselves are checked in-process in tests/unit/test_bad_config.py)."""

from __future__ import annotations

import pytest
from conftest import run_cli


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["trainer.max_stepz=3"],
            "error: unknown config key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)",
        ),
        (["-m", "optimizer.lr=1e-3,2"], "error: optimizer.lr=2 is not valid"),
        (["optimizer.lr=1e-3,2e-3"], "error: optimizer.lr=1e-3,2e-3 is a sweep over several values: add -m"),
        (["--cfg", "job", "data.packing=maybe"], "error: data.packing='maybe' is not valid"),
        # raised inside a constructor Hydra instantiates: still one line, naming the key
        (
            ["+trainer.bogus=1"],
            "error: trainer: Trainer.__init__() got an unexpected keyword argument 'bogus'",
        ),
        # a layout tensor parallelism cannot split (more in tests/unit/test_model_parallel_config.py)
        (
            ["strategy=model_parallel", "trainer.devices=2", "strategy.tp=2", "model.num_key_value_heads=1"],
            "error: strategy.tp=2 must divide model.num_key_value_heads=1 (each tp rank takes 1/tp of it)",
        ),
    ],
)
def test_cli_prints_one_line_and_exits_2(tmp_path, args, message):
    proc = run_cli(
        "parallama.cli.train", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert message in out
    assert "Traceback" not in out and "Error executing job" not in out
    assert len([line for line in out.splitlines() if "error:" in line]) == 1
