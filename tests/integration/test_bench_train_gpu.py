"""`python -m bench train-gpu` cannot rot while no GPU runs it: a dry run of its arms on CPU (one step each, tiny
sizes; its timings mean nothing), and every lever's parallama-train command composes (keys and values checked as
parallama-train checks them)."""

from __future__ import annotations

import json
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.train_gpu import LEVERS, command
from parallama.config.compose import compose_tool

ARMS = ["default", "callbacks=none", "bare eager", "titan compile", "loss.impl=fused"]


def test_a_dry_run_times_parallama_train_the_bare_loop_and_skips_torchtitan_with_its_reason(
    capsys, tmp_path, data_cache
):
    out = tmp_path / "train_gpu.json"
    argv = ["train-gpu", "--dry-run", "--warmup", "1", "--steps", "1", "--arms", *ARMS]
    main([*argv, "--cache-dir", str(data_cache), "--out", str(out)])
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["benchmark"] == "train-gpu" and result["dry_run"] and "# cpu: " in text
    rows = result["results"]["tiny"]
    assert list(rows) == ["default", "bare eager", "titan compile", "callbacks=none", "loss.impl=fused"]
    for name in ("default", "callbacks=none", "bare eager"):  # ran: the Clock's figures (no GPU: no peak)
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["peak_bytes"] == 0, rows[name]
    assert rows["default"]["command"].startswith(
        "parallama-train model=tiny data.seq_len=64 data.batch_size=2"
    )
    assert "CUDA" in rows["titan compile"]["skipped"]
    assert rows["loss.impl=fused"]["tokens_per_s"] > 0
    assert result["ratios"]["tiny"]["default / bare eager"] > 0


@pytest.mark.parametrize("model", ["llama3_2_1b", "llama_180m"])
def test_every_lever_composes_as_parallama_train_checks_it(tmp_path, model):
    args = Namespace(dry_run=False, warmup=10, steps=20, cache_dir=str(tmp_path))
    for name, lever in LEVERS.items():
        line = command(model, lever, args, tmp_path / "run", tmp_path / "clock.json")
        overrides = [o for o in line[3:] if not o.startswith("hydra.")]
        cfg = compose_tool("train", overrides)
        assert cfg.model.hidden_size in (2048, 768), name
        assert cfg.callbacks.bench_clock._target_ == "bench.train_gpu.Clock", name
        assert ("last_checkpoint" in cfg.callbacks) is False, name


def test_without_cuda_train_gpu_says_so(capsys):
    main(["train-gpu"])
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize("script", ["gpu_wheels.sh", "gpu_run.sh"])
def test_the_gpu_scripts_parse(script):
    bench = Path(__file__).resolve().parents[2] / "bench"
    assert subprocess.run(["bash", "-n", str(bench / script)]).returncode == 0
