"""parallama-plan on the real command line: the table, the recommendation, and a strategy class from outside."""

import json

from conftest import run_cli


def test_cli_prints_table_and_recommendation(tmp_path):
    args = ["model=llama3_8b", "trainer.devices=8", "gpu_memory_gb=80"]
    out = run_cli("parallama.cli.plan", *args, cwd=tmp_path).stdout
    assert "deepspeed_3_offload" in out and "activations" in out
    assert "Recommendation:" in out and "\nparallama-train model=llama3_8b trainer.devices=8 strategy=" in out


def test_a_new_strategy_class_appears_in_the_plan_with_no_other_file_touched(tmp_path):
    """Adding a strategy = one class + one config file: parallama-plan reads the class's own declaration."""
    (tmp_path / "my_strategies.py").write_text(
        "from parallama.parallel.plan import MemoryProfile\n"
        "from parallama.parallel.strategies.ddp import DDP\n\n\n"
        "class Halved(DDP):\n"
        "    name = 'halved'\n"
        "    memory_profiles = (MemoryProfile('halved', 'strategy=halved', 'autocast', 'go', guide='sharded'),)\n"
    )
    (tmp_path / "conf" / "strategy").mkdir(parents=True)
    (tmp_path / "conf" / "strategy" / "halved.yaml").write_text("_target_: my_strategies.Halved\n")
    args = ["--config-dir", str(tmp_path / "conf"), "model=llama3_8b", "trainer.devices=8", "json=true"]
    out = run_cli("parallama.cli.plan", *args, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}).stdout
    estimates = json.loads(out)["estimates"]
    assert list(estimates)[:3] == ["ddp", "halved", "ddp_sharded"]  # its guide step, before the built-ins
    assert estimates["halved"]["optim"] == estimates["ddp_sharded"]["optim"]  # sharded like ZeRO-1's
    assert estimates["halved"]["grads"] < estimates["ddp"]["grads"]
    # a class that does not import is one line naming its file (found: Hydra's own 3-line report came first)
    (tmp_path / "my_strategies.py").write_text("from parallama.parallel.base import MemoryProfile\n")
    proc = run_cli("parallama.cli.plan", *args, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, check=False)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(
        f"error: {tmp_path / 'conf' / 'strategy' / 'halved.yaml'}: _target_=my_strategies"
    )
    assert "cannot import name 'MemoryProfile' from 'parallama.parallel.base'" in lines[0]
