"""`python -m bench train-gpu` cannot rot while no GPU runs it: a dry run of its arms on CPU (tiny sizes, two
interleaved rounds; its timings mean nothing), and every lever's parallama-train command composes (keys and values
checked as parallama-train checks them) for every model the GPU call runs."""

from __future__ import annotations

import json
import shlex
import subprocess
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from bench.__main__ import main
from bench.clock import PHASES
from bench.step_time import summary
from bench.train_gpu import LEVERS, MODELS, command
from parallama.app.compose import compose_tool

ARMS = ["default", "bare eager", "titan compile"]


def test_a_dry_run_interleaves_the_arms_times_windows_profiles_and_skips_torchtitan_with_its_reason(
    capsys, tmp_path, data_cache
):
    out = tmp_path / "train_gpu.json"
    argv = ["train-gpu", "--dry-run", "--warmup", "1", "--steps", "1", "--windows", "2", "--rounds", "2"]
    main([*argv, "--arms", *ARMS, "--cache-dir", str(data_cache), "--out", str(out)])
    text = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["benchmark"] == "train-gpu" and result["dry_run"] and "# cpu: " in text
    ran = [line.split()[1:4] for line in text.splitlines() if line.startswith("round ")]
    # round 1 in PLAN's order, round 2 rotated by one; torchtitan skipped once, not tried again
    assert ran == [
        ["1", "tiny", "default"],
        ["1", "tiny", "bare"],
        ["1", "tiny", "titan"],
        ["2", "tiny", "bare"],
        ["2", "tiny", "default"],
    ]
    rows = result["results"]["tiny"]
    for name in ("default", "bare eager"):  # two runs of two windows each: the median of 4 and their spread
        row = rows[name]
        assert row["windows"] == 4 and row["spread"][0] <= row["tokens_per_s"] <= row["spread"][1], row
        assert row["torch"] == torch.__version__ and row["peak_bytes"] == 0, row  # no GPU: no peak
    first, second = rows["default"]["runs"]
    profile = first["profile"]  # the first run of a parallama-train arm profiles one step after its windows
    assert profile["clock"] == "cpu" and profile["ms_per_step_by_kind"] == {}  # kernels: on a GPU only
    assert set(profile["ms_per_step_in_ranges"]) == {"parallama.loss", "parallama.clip_gradients"}
    for arm in ("default", "bare eager"):  # the bare loop's step split as parallama-train's (`profile_step`)
        parts = rows[arm]["runs"][0]["profile"]["ms_per_step_by_part"]  # no "other" without kernel times
        assert set(parts) == {"blocks", "head+loss", "optimizer", "clip"} and min(parts.values()) > 0, parts
        assert "profile" not in rows[arm]["runs"][1]  # round 2 does not profile
    assert profile["top_ops"] and "profile" not in second
    # where each run's seconds went, launch to exit, phase by phase (the second run has no profile)
    phases = ["launch", *PHASES, "exit"]
    for run, reached in ((first, phases), (second, phases[:-2] + ["exit"])):
        timeline = run["timeline_s"]
        assert list(timeline) == [f"{a}-{b}" for a, b in zip(reached, reached[1:])], timeline
        assert all(s >= 0 for s in timeline.values()), timeline
        assert sum(timeline.values()) <= run["seconds"] + 0.1, run  # (rounded: to 0.01 s, the run to 0.1 s)
    assert "CUDA" in rows["titan compile"]["error"]
    assert result["ratios"]["tiny"] == {}  # none of RATIOS' pairs ran both arms
    assert "arm runs forked from a process with torch, Lightning and Hydra imported" in result["notes"][1]


def test_a_run_cut_by_its_timeout_says_how_far_it_got_and_a_torn_clock_file_reads_as_nothing(tmp_path):
    """A run killed at its timeout keeps its timeline (here: killed before Lightning's setup, still importing), and
    the Clock file a kill tore in the middle of a write reads as nothing rather than ending the benchmark."""
    from bench.train_gpu import clock_file, train_run

    args = Namespace(dry_run=True, warmup=1, steps=1, windows=1, cache_dir=str(tmp_path))
    result = train_run("tiny", [], args, tmp_path, "cut", timeout=1, profile=0, fork=False)
    assert result["error"] == "timed out after 1 s" and list(result["timeline_s"]) == ["launch-exit"], result
    assert 1 <= result["timeline_s"]["launch-exit"] < 10, result
    (tmp_path / "torn.json").write_text('{"rates": [6195.2')
    assert clock_file(tmp_path / "torn.json") == {} and clock_file(tmp_path / "absent.json") == {}


def test_the_profile_counts_each_kernel_once_and_splits_the_step_into_its_parts_forward_and_backward():
    """On a GPU, torch's profiler gives a `record_function` range twice: the CPU event (its device time: the kernels
    launched inside) and an annotation on the GPU's timeline spanning them. The first H200 profiles counted the
    annotations too: Lightning's `Optimizer.step`, which wraps forward and backward, became 128 ms of "other"
    kernels in a 129 ms step, and clipping read 8.5 ms for 4.1 ms of kernels. The parts: a part's range holds its
    forward, the autograd nodes its ops made (same sequence number, run on the backward's thread) its backward, a
    node run inside another counts once, a gradient's accumulation is in no part. A step of that shape, made of
    torch's own profiler events (no GPU here to record one; the dry run above splits a real step, on its CPU)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from bench.step_time import BACKWARD

    events = []

    def event(
        name, start_ms, end_ms, gpu=False, annotation=False, thread=1, seq=-1, kernel_ms=0.0, kind="nvjet"
    ):
        device, thread = (DeviceType.CUDA, 7) if gpu else (DeviceType.CPU, thread)
        e = FunctionEvent(len(events), name, thread, start_ms * 1000, end_ms * 1000, fwd_thread=1, use_device="cuda",
                          stack=[], device_type=device, is_user_annotation=annotation, sequence_nr=seq)  # fmt: skip
        if kernel_ms:
            e.append_kernel(kind, 0, kernel_ms * 1000)
            events.append(event(kind, start_ms, start_ms + kernel_ms, gpu=True))
        return e

    step = event("Optimizer.step#AdamW.step", 0, 130, annotation=True)
    cpu = [
        step,
        event("bench.blocks", 1, 20, annotation=True),
        event("CompiledFunction", 2, 19, seq=10, kernel_ms=30),  # a compiled block's forward
        event("bench.head+loss", 21, 30, annotation=True),
        event("aten::mm", 22, 29, seq=20, kernel_ms=5),  # the head's
        event(BACKWARD + "MmBackward0", 31, 40, thread=2, seq=20, kernel_ms=8),
        event(BACKWARD + "CompiledFunctionBackward", 41, 90, thread=2, seq=10, kernel_ms=50),
        event(
            BACKWARD + "CheckpointFunctionBackward", 50, 60, thread=2, seq=10, kernel_ms=6
        ),  # inside the above
        event(
            BACKWARD + "torch::autograd::AccumulateGrad", 91, 92, thread=2, kernel_ms=1, kind="elementwise"
        ),
        event("bench.optimizer", 100, 125, annotation=True),
        event("parallama.clip_gradients", 101, 106, annotation=True, kernel_ms=4, kind="elementwise"),
        event("aten::_fused_adamw_", 107, 120, kernel_ms=10, kind="multi_tensor_apply_kernel"),
    ]
    on_gpu = [
        event("Optimizer.step#AdamW.step", 0, 128, gpu=True, annotation=True)
    ]  # the annotations' copies
    on_gpu.append(event("parallama.clip_gradients", 100, 104.4, gpu=True, annotation=True))
    found = EventList([*cpu, *events, *on_gpu], use_device="cuda")
    found._build_tree()
    result = summary(SimpleNamespace(key_averages=found.key_averages, events=lambda: found), steps=1)
    assert result["ms_per_step_by_kind"] == {"attention": 0.0, "matmul": 99.0, "other": 15.0}
    assert result["ms_per_step_by_part"] == {
        "blocks": 86.0,  # 30 forward, 50 + 6 backward (the checkpoint's node inside the block's: once)
        "head+loss": 13.0,
        "optimizer": 10.0,
        "clip": 4.0,
        "other": 1.0,  # the gradient's accumulation
    }
    assert result["ms_per_step_in_ranges"] == {"parallama.clip_gradients": 4.0}
    assert result["top_ops"][0] == {"name": "nvjet", "calls": 5, "self_ms": 99.0}  # the kernels, by name


def test_the_optimizer_part_holds_an_optimizer_stepped_inside_the_one_lightning_steps():
    """Muon's AdamW half is a torch AdamW stepped inside `MuonAdamW.step`. Closed at any optimizer's step end (the
    global post-hook), the optimizer's range ended inside that AdamW's own range: the profiler's tree then put the
    AdamW's ops outside it, and on a GPU their kernels in no part. Closed at the end of the step of the optimizer
    Lightning steps, the range holds it whole."""
    from torch.profiler import ProfilerActivity, profile

    from bench.step_time import StepParts

    model = torch.nn.Linear(8, 8)

    class Outer(torch.optim.Optimizer):  # the shape of MuonAdamW.step
        def __init__(self, params) -> None:
            super().__init__(params, {})
            self.inner = torch.optim.AdamW(self.param_groups[0]["params"])

        def step(self, closure=None) -> None:
            with torch.enable_grad():
                closure()
            self.inner.step()

    optimizer = Outer(model.parameters())
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        parts = StepParts(model, [optimizer])

        def closure() -> None:  # Lightning's: the training step, the backward, then on_before_optimizer_step
            model(torch.randn(4, 8)).sum().backward()
            parts.begin("optimizer")

        optimizer.step(closure)
        parts.remove()
    inner = next(e for e in profiler.events() if e.name == "Optimizer.step#AdamW.step")
    assert inner.cpu_parent.name == "bench.optimizer"


@pytest.mark.parametrize("model", list(MODELS))
def test_every_lever_composes_as_parallama_train_checks_it(tmp_path, model):
    args = Namespace(dry_run=False, warmup=10, steps=10, windows=3, cache_dir=str(tmp_path))
    for name, lever in LEVERS.items():
        line = command(model, lever, args, tmp_path / "run", tmp_path / "clock.json", profile=1)
        overrides = [o for o in line[3:] if not o.startswith("hydra.")]
        cfg = compose_tool("train", overrides)
        assert cfg.model.hidden_size in (2048, 768, 4096), name
        assert cfg.callbacks.bench_clock._target_ == "bench.clock.Clock", name
        assert ("last_checkpoint" in cfg.callbacks) is False, name
        # enough optimizer steps for the warm-up (at least 2), the windows and the profiled step
        accumulate = cfg.trainer.accumulate_grad_batches
        assert cfg.trainer.max_steps * accumulate >= 10 + 3 * 10 + accumulate, name


def test_without_cuda_train_gpu_says_so(capsys):
    main(["train-gpu"])
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize("script", ["gpu_wheels.sh", "gpu_run.sh"])
def test_the_gpu_scripts_parse(script):
    bench = Path(__file__).resolve().parents[2] / "bench"
    assert subprocess.run(["bash", "-n", str(bench / script)]).returncode == 0


def test_every_benchmark_command_of_the_gpu_script_parses_and_names_known_arms():
    """bench/gpu_run.sh runs only on a lent GPU, where a typo in an option or an arm costs the lease: each of its
    `python3 -m bench ...` commands parses as `python -m bench` parses it, and each train-gpu call's arms are known
    and run (every arm it names is scheduled, for a model the call runs)."""
    from bench.__main__ import parser
    from bench.train_gpu import check_arms, schedule

    script = (Path(__file__).resolve().parents[2] / "bench" / "gpu_run.sh").read_text().replace("\\\n", " ")
    lines = [
        line.split("python3 -m bench ", 1)[1] for line in script.splitlines() if "python3 -m bench " in line
    ]
    assert len(lines) == 5, lines  # calls 1, 2 and 3: train-gpu each; bench loss and optim-step
    train_calls = 0
    for line in lines:
        words = shlex.split(line.split("||")[0].replace('"$left"', "300").replace('"$budget"', "470"))
        args = parser().parse_args(words)
        if args.name != "train-gpu":
            continue
        train_calls += 1
        check_arms(args)
        scheduled = {(model, arm) for _, model, arm in schedule(args)}
        for named in args.arms:
            model, _, arm = named.rpartition(":")
            assert all((m, arm) in scheduled for m in ([model] if model else args.models)), (named, scheduled)
    assert train_calls == 3


def test_by_default_every_arm_runs_in_two_interleaved_rounds_of_three_windows():
    """The fairness the GPU figures rest on (issue #37): the first GPU run of this benchmark took an unintended
    default of 2 windows and, its budget spent, no second round."""
    import argparse

    from bench.train_gpu import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert args.windows >= 3 and args.rounds >= 2 and args.profile == 1


def test_arms_named_for_a_model_run_even_where_its_plan_lacks_them_and_a_stray_model_is_refused():
    """`--arms` selects from PLAN in its order and adds what PLAN lacks for that model (it had dropped those
    silently); an arm for a model the call does not run is one line before any run."""
    from bench.train_gpu import run, schedule

    args = Namespace(dry_run=False, models=["llama3_2_1b", "llama_180m"], rounds=2)
    args.arms = ["llama_180m:residual=bf16", "default", "llama3_2_1b:titan best"]
    assert schedule(args) == [
        (0, "llama3_2_1b", "default"),
        (0, "llama3_2_1b", "titan best"),
        (0, "llama_180m", "default"),
        (0, "llama_180m", "residual=bf16"),
        (1, "llama3_2_1b", "titan best"),
        (1, "llama3_2_1b", "default"),
        (1, "llama_180m", "residual=bf16"),
        (1, "llama_180m", "default"),
    ]
    args.arms = ["llama3_8b_4l:default"]
    with pytest.raises(
        SystemExit, match=r"^--arms: llama3_8b_4l is not among the models run \(llama3_2_1b, llama_180m\)$"
    ):
        run(Namespace(**{**vars(args), "bare": None}))


def test_the_residual_lever_puts_the_stream_between_blocks_in_the_compute_dtype():
    """bench/levers.py's candidate (`residual=bf16`): under autocast the blocks take bf16 hidden states, not the
    embedding's fp32; without autocast (CPU's 32-true) nothing changes."""
    from bench.levers import ResidualInComputeDtype
    from parallama.training.module import CausalLM

    model = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    optimizer = dict(_target_="torch.optim.AdamW", lr=1e-3)
    scheduler = dict(_target_="parallama.training.schedules.Constant")
    module = CausalLM(model=model, optimizer=optimizer, scheduler=scheduler)
    module.configure_model()
    seen = []
    module.model.layers["1"].register_forward_pre_hook(lambda layer, args: seen.append(args[0].dtype))
    ResidualInComputeDtype().on_fit_start(None, module)
    tokens = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", torch.bfloat16):
        module.model(tokens)
    module.model(tokens)
    assert seen == [torch.bfloat16, torch.float32]
