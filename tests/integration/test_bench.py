"""Smoke test of `python -m bench`: each CPU benchmark runs with tiny settings and reports in its format.
Performance is not checked here (see docs/benchmarks.md); the overhead benchmark's loss check is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]

from bench.__main__ import main  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def run(capsys, tmp_path, cache: str, *argv: str, process: bool = False) -> tuple[str, dict]:
    """`python -m bench <argv>`: in this process, or (`process`, benchmarks that start ranks) as a subprocess."""
    out = tmp_path / "result.json"
    args = [*argv, "--cache-dir", cache, "--out", str(out)]
    if process:
        text = run_cli("bench", *args, cwd=ROOT, timeout=600).stdout
    else:
        main(args)
        text = capsys.readouterr().out
    assert "# cpu: " in text and "torch " in text  # absolute numbers come with the machine
    result = json.loads(out.read_text())
    assert result["benchmark"] == argv[0] and result["machine"]["torch"] == torch.__version__
    return text, result


def test_overhead(capsys, tmp_path, cache):
    tiny = ["--warmup", "1", "--steps", "2", "--repeats", "1", "--batch", "2", "--seq-len", "32"]
    text, result = run(capsys, tmp_path, cache, "overhead", *tiny)
    assert set(result["arms"]) == {"plain", "lightning", "lightning+default_callbacks"}
    assert all(len(v) == 1 for v in result["steps_per_s"].values())
    assert all(arm["same_loss"] for arm in result["arms"].values()), result["final_loss"]
    assert "Lightning path overhead:" in text


def test_data(capsys, tmp_path, cache):
    tiny = ["--corpus", "prose", "--max-documents", "12", "--bpe-vocab", "300", "--seq-len", "32"]
    tiny += ["--batch", "2", "--batches", "3", "--warmup-batches", "1", "--repeats", "1"]
    tiny += ["--model-steps", "1", "--part-chars", "5000", "--prepare-times", "1", "--rss-multiples", "1"]
    text, result = run(capsys, tmp_path, cache, "data", *tiny)
    assert set(result["tokenizer_tokens_per_s"]) == {"byte_level", "bpe_300"}
    assert len(result["loader_tokens_per_s"]) == 4 and min(result["loader_tokens_per_s"].values()) > 0
    assert 4e5 < result["goal"]["tokens_per_s"] < 6e5  # llama_180m at 45% of 989 TFLOP/s
    assert "worst headroom" in text
    masked = result["document_mask"]
    assert len(masked["loader_tokens_per_s"]) == 2
    assert all(r["on"] > 0 for r in masked["loader_tokens_per_s"].values())
    assert masked["model_cpu"]["mask_over_is_causal"] > 0
    assert len(result["prepare"]["tokens_per_s"]) == 5 and min(result["prepare"]["tokens_per_s"].values()) > 0
    assert set(result["prepare"]["ratios"]) >= set(result["prepare"]["goals"])
    assert result["prepare_peak_rss_mb"]["1x"]["tree"] > 0 and "largest peak" in text


@pytest.mark.multiprocess
@pytest.mark.slow  # 1 and 2 ranks, twice: ~40 s; `make bench` runs the real thing
def test_ddp_scaling(capsys, tmp_path, cache):
    tiny = ["--warmup", "1", "--steps", "2", "--repeats", "1", "--batch", "2", "--seq-len", "32"]
    text, result = run(capsys, tmp_path, cache, "ddp-scaling", *tiny, process=True)
    assert set(result["tokens_per_s"]) == {"plain x1", "plain x2", "parallama x1", "parallama x2"}
    assert all(v[0] > 0 for v in result["tokens_per_s"].values())
    assert set(result["scaling"]) == set(result["scaling_per_round"]) == {"plain", "parallama"}
    assert "parallama 2-process scaling" in text


def test_checksum(capsys, tmp_path, cache):
    """Both formats saved plain and checksummed, and verified: the seconds per GB docs/benchmarks.md quotes."""
    text, result = run(capsys, tmp_path, cache, "checksum", "--dry-run", "--dir", str(tmp_path))
    assert set(result["seconds_per_gb"]) == {"file", "dcp"}
    assert all(v["verify"] > 0 for v in result["seconds_per_gb"].values())
    assert set(result["hash_gb_per_s"]) == {"sha256", "blake2b"} and "one core hashes" in text
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # its checkpoints removed


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this is the full ~10 minute benchmark")
def test_gpu_without_cuda_exits_cleanly(capsys):
    main(["gpu"])
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_nd(capsys, tmp_path, cache):
    """Four layouts that take different paths on 2 gloo ranks: FSDP's all-gathers, TP's DTensor all-reduces, the
    pipeline's sends between its two stages, and between a V's four (zbv)."""
    tiny = ["--warmup", "1", "--steps", "1", "--repeats", "1", "--global-batch", "4", "--seq-len", "32"]
    names = ("fsdp", "tp", "pp", "pp zbv")
    text, result = run(capsys, tmp_path, cache, "nd", *tiny, "--layouts", *names, process=True)
    layouts = result["layouts"]
    assert set(layouts) == set(names) and layouts["tp"]["dims"]["tp"] == 2
    assert layouts["fsdp"]["step_ratio_to_fsdp"] == 1.0 and layouts["tp"]["step_ratio_to_fsdp"] > 0
    assert layouts["fsdp"]["collective_mb_per_step"]["all_gather"] > 0  # the sharded weights gathered
    assert layouts["tp"]["collective_mb_per_step"]["all_reduce"] > 0  # the row-wise layers' partial sums
    assert "all_gather" not in layouts["tp"]["collective_mb_per_step"]  # tp=2 x dp 1: nothing to gather
    pp = layouts["pp"]["collective_mb_per_step"]
    assert layouts["pp"]["dims"]["pp"] == 2 and "recv" not in pp and "all_gather" not in pp
    # 2 microbatches of (2, 32, 128) fp32 activations forward (rank 0), their gradients backward (rank 1)
    assert pp["send"] == pytest.approx(2 * 2 * (2 * 32 * 128 * 4) / 2 / 1e6)
    # the V crosses between the ranks twice (stages 0 -> 1 and 2 -> 3), 4 microbatches of half the rows
    assert layouts["pp zbv"]["collective_mb_per_step"]["send"] == pytest.approx(2 * pp["send"])
    assert "layout" in text and "/ fsdp" in text and "pp schedule 1f1b" in text


@pytest.mark.multiprocess
def test_nd_moe(capsys, tmp_path, cache):
    """qwen3_moe_tiny under ep=2 on 2 gloo ranks: the tokens' all-to-alls apart from the counts' exchange,
    dispatch and combine each exactly a rank's tokens x top-2 x 128 fp32 values per sparse block (3), forward
    and backward (averaged over the ranks); the pipeline layouts are skipped in one line."""
    tiny = ["--warmup", "1", "--steps", "1", "--repeats", "1", "--global-batch", "4", "--seq-len", "32"]
    args = ("nd", "--model", "qwen3_moe_tiny", *tiny, "--layouts", "ep", "pp")
    text, result = run(capsys, tmp_path, cache, *args, process=True)
    assert set(result["layouts"]) == {"fsdp", "ep"} and "nd: skipping pp with model=qwen3_moe_tiny" in text
    ep = result["layouts"]["ep"]["collective_mb_per_step"]
    tokens = 4 // 2 * 32
    assert (
        ep["all_to_all dispatch"]
        == ep["all_to_all combine"]
        == pytest.approx(2 * 3 * tokens * 2 * 128 * 4 / 1e6)
    )
    assert ep["all_to_all"] == pytest.approx(3 * 8 * 8 / 1e6)  # each block's tokens per expert (int64)
    assert "all_to_all dispatch" not in result["layouts"]["fsdp"]["collective_mb_per_step"]


def test_step_path(capsys, tmp_path, cache):
    """The trace of what runs from the command line to the optimizer's update (the figures docs/architecture.md
    quotes): the step is the module, the loss and the model; the path adds the call stack from the command line,
    and stays within issue #27's aim; each set holds the one before it."""
    text, result = run(capsys, tmp_path, cache, "step-path", process=True)
    sets = [result[name] for name in ("training_step", "path", "first batch", "command line")]
    step, path = set(sets[0]["by_file"]), set(sets[1]["by_file"])
    assert {"training/module.py", "training/loss.py", "models/llama/model.py"} <= step
    assert {"cli/train.py", "cli/app.py", "app/run.py"} <= path - step
    for smaller, larger in zip(sets, sets[1:]):
        assert set(smaller["by_file"]) <= set(larger["by_file"]) and smaller["lines"] <= larger["lines"]
    assert "app/checks.py" in sets[3]["by_file"] and "app/checks.py" not in sets[2]["by_file"]
    path, aim = result["path"], result["aim"]
    assert path["files"] <= aim["files"] and path["lines"] <= aim["lines"], path
    assert "the path, against issue #27's aim" in text and ": within" in text


def test_loss(capsys, tmp_path, cache):
    """`bench loss` (the fused loss against the plain one), tiny: each variant in its own process, the same
    weights after the same steps (SGD: an update linear in the gradient, see docs/benchmarks.md)."""
    tiny = ["--vocab", "512", "--seq-len", "64", "--hidden", "32", "--layers", "1", "--steps", "2"]
    tiny += ["--chunk-size", "24", "--optimizer", "sgd"]
    text, result = run(capsys, tmp_path, cache, "loss", *tiny)
    assert set(result["results"]) == {"plain", "fused"} and set(result["ratios"]) == {
        "forward_backward_time_interleaved",
        "step_peak",
        "peak_rss",
        "step_time",
    }
    assert all(r["step_s"] > 0 and r["peak_rss_mb"] > 0 for r in result["results"].values())
    assert result["weights_max_abs_diff"] < 1e-5 < 1e-3 < result["weights_max_abs_change"]
    assert "fused / plain: step peak" in text


def test_optim_step(capsys, tmp_path, cache):
    """`bench optim-step --dry-run` (AdamW, Muon, Muon by the Gram matrix and the old one-by-one Muon) on a tiny
    Llama on the CPU; on a GPU it times Llama-3.2-1B's (docs/benchmarks.md)."""
    text, result = run(capsys, tmp_path, cache, "optim-step", "--dry-run")
    assert result["dry_run"] and result["device"] == "cpu" and result["model"] == "tiny"
    assert set(result["results"]) == {"adamw", "muon", "muon_standard", "muon_one_by_one"}
    assert all(r["step_ms"] > 0 for r in result["results"].values())
    assert result["muon_matrices"] == 4 * 7  # tiny: 4 blocks of 7 projections
    assert 0 < result["gram_newton_schulz_tflop"] < result["newton_schulz_tflop"]
    errors = result["bf16_error_against_fp32"]  # each shape's bf16 iteration, by each method, against fp32's
    assert set(errors) == {"64x128", "128x128", "128x384", "384x128"}
    assert all(0 < e["standard"] < 0.05 and e["gram / standard"] <= 3 for e in errors.values())
    assert "# muon / adamw: " in text
