"""The N-D experiment presets (conf/experiment/plan: what a CPU cannot run) compose on a CPU machine:
`parallama-train experiment=plan/<preset> --cfg job`."""

import pytest
from conftest import run_cli
from omegaconf import OmegaConf


@pytest.mark.parametrize("preset", ["plan/llama3_8b_tp", "plan/llama3_70b_nd"])
def test_presets_compose_on_a_cpu_machine(preset, tmp_path):
    out = run_cli("parallama.cli.train", f"experiment={preset}", "--cfg", "job", cwd=tmp_path).stdout
    cfg = OmegaConf.create(out)
    assert cfg.strategy._target_.endswith(".ModelParallel") and cfg.trainer.accelerator == "auto"
    assert cfg.strategy.tp > 1 and cfg.strategy.sequence_parallel and cfg.activation_checkpointing
