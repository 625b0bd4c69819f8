"""`train-gpu`: `parallama-train` itself on one GPU (the user's command, default callbacks), each lever on and off,
beside the bare loop and torchtitan 0.3 on the same GPU in the same call; results as JSON (bench/results/).

Arms, in the order they run (the most telling first; a time budget, `--budget-s`, skips the rest and says so):
- `parallama-train model=<m> data.seq_len=S data.batch_size=B` as a user runs it (`default`), then one lever at a
  time on top of `compile=true`: `float8=tensorwise|rowwise`, `activation_checkpointing=selective|full`,
  `optimizer=muon`, `loss.impl=fused`, `callbacks=none` (what the default callbacks cost), and the levers together
  (`best`).
  Validation, the sample and the checkpoint callbacks are off (they act outside the timed steps); the embedded
  corpus, byte tokenizer, the preset's vocabulary.
  Timed by `Clock` (added as a callback): tokens/s from step `--warmup` to the last (`--steps` later), with one
  synchronize at each end, and the peak allocated memory.
- the bare loop (bench/gpu.py's `measure`: the parallama model in plain PyTorch, random tokens), eager and
  compiled;
- torchtitan (bench/titan.py): its Llama 3 "1B" with its own parallelize: compile, + selective AC, + rowwise
  float8 (0.3 has no tensorwise), and eager; the 1B only (it has no 180M flavor).
MFU = `LlamaConfig.flops_per_token(seq_len)` x tokens/s / the GPU's dense bf16 peak, for every arm alike.

`--dry-run`: every arm once on a CPU at tiny sizes (2 steps, no compile: it would add ~30 s per arm there);
torchtitan is skipped with the reason (it builds its mesh on CUDA and imports triton). Timings of a dry run mean
nothing. On the GPU machines: bench/gpu_run.sh (installs bench/gpu_wheels.sh's wheels offline, then runs this).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from omegaconf import OmegaConf

from bench.common import ROOT, free_port, machine, print_machine, save

MODELS = {"llama3_2_1b": (2048, 4), "llama_180m": (512, 16)}  # seq_len, micro-batch (bench/gpu.py's presets)
BASE = ["compile=true"]
LEVERS = {  # name -> overrides; each lever on top of BASE, but `default` (the user's command as it is)
    "default": [],
    "compile": BASE,
    "callbacks=none": [*BASE, "callbacks=none"],
    "float8=tensorwise": [*BASE, "float8=tensorwise"],
    "loss.impl=fused": [*BASE, "loss.impl=fused"],
    "ac=selective": [*BASE, "activation_checkpointing=selective"],
    "optimizer=muon": [*BASE, "optimizer=muon"],
    "float8=rowwise": [*BASE, "float8=rowwise"],
    "ac=full": [*BASE, "activation_checkpointing=full"],
    "best": [*BASE, "float8=tensorwise", "loss.impl=fused"],
}
TITAN = {  # torchtitan arms (bench/titan.py): compile, activation checkpointing, float8
    "titan compile": {"compile": True, "ac": "none", "float8": None},
    "titan compile+float8=rowwise": {"compile": True, "ac": "none", "float8": "rowwise"},
    "titan compile+ac=selective": {"compile": True, "ac": "selective", "float8": None},
    "titan eager": {"compile": False, "ac": "none", "float8": None},
}
DRY_MODELS = {"tiny": (64, 2)}  # --dry-run's


def shape(model: str) -> tuple[int, int]:
    return {**MODELS, **DRY_MODELS}[model]


class Clock(L.Callback):
    """Added to the timed parallama-train runs (`+callbacks.bench_clock`): tokens/s from optimizer step `start` to
    the run's last, a synchronize at each end only, and the peak allocated bytes; written as JSON to `path`."""

    def __init__(self, path: str, start: int) -> None:
        self.path, self.start = path, start
        self.t0, self.tokens = 0.0, 0

    def _sync(self, trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self.start:
            self._sync(trainer)
            self.t0, self.tokens = time.perf_counter(), 0
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
        elif step > self.start:
            self.tokens += batch["input_ids"].numel()
        if step == trainer.max_steps and trainer.is_global_zero:
            self._sync(trainer)
            peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
            rate = self.tokens / (time.perf_counter() - self.t0)
            Path(self.path).write_text(json.dumps({"tokens_per_s": rate, "peak_bytes": peak}))


def command(model: str, lever: list[str], args, run_dir: Path, out: Path) -> list[str]:
    """The `parallama-train` command of an arm (its Clock writes `out`)."""
    seq_len, batch = shape(model)
    overrides = [o for o in lever if not (args.dry_run and o == "compile=true")]
    line = [
        sys.executable, "-m", "parallama.cli.train", f"model={model}",
        f"data.seq_len={seq_len}", f"data.batch_size={batch}", f"trainer.max_steps={args.warmup + args.steps}",
        "trainer.limit_val_batches=0", "validate_before_training=false", "sample.max_new_tokens=0",
        f"paths.cache_dir={args.cache_dir}", f"hydra.run.dir={run_dir}", *overrides,
    ]  # fmt: skip
    if "callbacks=none" not in overrides:
        line += ["~callbacks.last_checkpoint", "~callbacks.model_checkpoint"]
    line += ["+callbacks.bench_clock._target_=bench.train_gpu.Clock", f"+callbacks.bench_clock.path={out}"]
    line += [f"+callbacks.bench_clock.start={args.warmup}"]
    return line + (["trainer.accelerator=cpu"] if args.dry_run else [])


def child_env() -> dict:
    """The arms' processes import `bench` and `parallama` from this checkout (not installed on the GPU machines)."""
    path = [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def train_arm(model: str, lever: list[str], args, tmp: Path, name: str, timeout: float) -> dict:
    """One `parallama-train` run; its Clock's figures, or the error's last lines."""
    out = tmp / f"{name}.json"
    line = command(model, lever, args, tmp / name, out)
    result = {"command": "parallama-train " + " ".join(line[3:])}
    try:
        proc = subprocess.run(
            line, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {**result, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not out.exists():
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        return {**result, "error": " | ".join(lines[-4:])}
    return {**result, **json.loads(out.read_text())}


def child(command: list[str], timeout: float) -> dict:
    """A `python -m ...` arm in its own process (the GPU's memory is its own); its `RESULT {json}` line."""
    env = child_env()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", *command],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        return {"error": " | ".join(lines[-4:])}
    return json.loads(found[-1][len("RESULT ") :])


def bare(model: str, compile: bool, args) -> None:
    """The bare loop's arm (run by `child`): bench/gpu.py's `measure` on the preset."""
    from bench.common import preset
    from bench.gpu import measure

    seq_len, batch = shape(model)
    cfg = preset(model, 320)  # 320: the byte tokenizer's, as parallama-train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loop = type("Loop", (), {"warmup": args.warmup, "steps": args.steps, "repeats": 1})
    rates, peak = measure(cfg, seq_len, batch, {"compile": compile and not args.dry_run}, device, loop)
    print("RESULT " + json.dumps({"tokens_per_s": rates[0], "peak_bytes": peak}), flush=True)


def arms(args) -> list[tuple[str, str, callable]]:
    """(model, arm name, how to run it with a timeout), in the order they run."""
    found = []
    models = list(DRY_MODELS) if args.dry_run else args.models
    for model in models:
        levers = dict(LEVERS)
        if model == "llama_180m":  # the small model: the levers that matter there
            levers = {k: v for k, v in levers.items() if k not in ("float8=rowwise", "ac=full", "best")}
        for name, lever in levers.items():
            found.append((model, name, lever))
            if name == "default":
                found += [(model, f"bare {c}", c) for c in ("eager", "compile")]
            if name == "compile" and model != "llama_180m":
                found += [(model, t, TITAN[t]) for t in TITAN]
    return [arm for arm in found if not args.arms or arm[1] in args.arms]


def run_arm(model: str, name: str, what, args, tmp: Path, timeout: float) -> dict:
    dry = ["--dry-run"] if args.dry_run else []
    steps = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    if name.startswith("bare"):
        return child(
            ["bench.train_gpu", "--bare", model, *(["--compile"] if what == "compile" else []), *steps, *dry],
            timeout,
        )
    if name.startswith("titan"):
        if args.dry_run:
            return {
                "skipped": "torchtitan 0.3 builds its device mesh on CUDA (no CPU path) and imports triton"
            }
        seq_len, batch = shape(model)
        arm = {"flavor": "1B", "seq_len": seq_len, "batch": batch, **what}
        arm.update(warmup=args.warmup, steps=args.steps, repeats=1, port=free_port())
        return child(["bench.titan", json.dumps(arm)], timeout)
    return train_arm(model, what, args, tmp, name.replace("=", "-").replace(" ", "_"), timeout)


def summarize(results: dict, peak_flops: float | None) -> dict:
    """MFU per arm, and the ratios the issue's goals are stated in."""
    from parallama.models.llama.config import LlamaConfig

    ratios = {}
    for model, rows in results.items():
        cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml"), resolve=True)
        cfg.pop("family")
        cfg["vocab_size"] = cfg["vocab_size"] or 320
        flops = LlamaConfig(**cfg).flops_per_token(shape(model)[0])
        for row in rows.values():
            if row.get("tokens_per_s"):
                row["peak_gib"] = row["peak_bytes"] / 2**30
                row["mfu"] = flops * row["tokens_per_s"] / peak_flops if peak_flops else None

        rate = {k: r.get("tokens_per_s") for k, r in rows.items()}.get
        pairs = {f"{k} / compile": (k, "compile") for k in rows if k not in ("compile", "default")}
        pairs["compile / default"] = ("compile", "default")
        pairs["default callbacks' cost (1 - compile / callbacks=none)"] = ("compile", "callbacks=none")
        pairs["default / bare eager"] = ("default", "bare eager")
        pairs["compile / bare compile"] = ("compile", "bare compile")
        pairs["compile / titan compile"] = ("compile", "titan compile")
        pairs["best / titan compile+float8=rowwise"] = ("best", "titan compile+float8=rowwise")
        ratios[model] = {}
        for label, (a, b) in pairs.items():
            if rate(a) and rate(b):
                value = rate(a) / rate(b)
                ratios[model][label] = 1 - value if "cost" in label else value
    return ratios


def run(args) -> dict:
    if args.bare:
        bare(args.bare, args.compile, args)
        return {}
    if args.arms and (unknown := set(args.arms) - {*LEVERS, *TITAN, "bare eager", "bare compile"}):
        raise SystemExit(f"--arms: unknown {', '.join(sorted(unknown))}")
    from bench.gpu import peak_flops

    info = machine()
    print_machine(info)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: train-gpu needs one (--dry-run runs every arm once on this CPU)")
        return {}
    peak = None if args.dry_run else peak_flops(torch.device("cuda"))
    results: dict = {}
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for model, name, what in arms(args):
            left = args.budget_s - (time.monotonic() - start)
            row = results.setdefault(model, {})
            if left < args.min_arm_s:
                row[name] = {"skipped": f"time budget: {left:.0f} s of --budget-s {args.budget_s} left"}
                continue
            t0 = time.monotonic()
            row[name] = run_arm(model, name, what, args, Path(tmp), min(left, args.arm_timeout_s))
            row[name]["seconds"] = round(time.monotonic() - t0, 1)
            shown = row[name].get("tokens_per_s") or row[name].get("skipped") or row[name].get("error")
            print(f"{model:12s} {name:32s} {row[name]['seconds']:6.1f} s  {shown}", flush=True)
            save(args.out, "train-gpu", info, {"results": results, "dry_run": args.dry_run})
    out = {"results": results, "ratios": summarize(results, peak), "dry_run": args.dry_run}
    out["notes"] = [
        "timings of a --dry-run (CPU, tiny sizes, 2 steps) mean nothing" if args.dry_run else
        f"{args.steps} timed steps after {args.warmup}; tokens/s per GPU",
    ]  # fmt: skip
    save(args.out, "train-gpu", info, out)
    print(json.dumps(out["ratios"], indent=2))
    return out


def add_arguments(p) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument(
        "--warmup", type=int, default=10, help="untimed optimizer steps (compilation happens there)"
    )
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per arm")
    p.add_argument("--budget-s", type=float, default=480, help="arms that would start later are skipped")
    p.add_argument(
        "--min-arm-s", type=float, default=40, help="an arm starts only with this much budget left"
    )
    p.add_argument("--arm-timeout-s", type=float, default=150, help="one arm's limit")
    p.add_argument(
        "--dry-run", action="store_true", help="every arm once on CPU, tiny sizes (checks the script)"
    )
    p.add_argument(
        "--arms", nargs="+", help="only these arms (names as in the results), e.g. default 'bare eager'"
    )
    p.add_argument("--bare", help=argparse.SUPPRESS, default=None)  # a bare-loop arm's child process
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)


if __name__ == "__main__":  # a bare-loop arm: python -m bench.train_gpu --bare <model> [--compile]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--cache-dir", default="data/cache")
    parser.add_argument("--out")
    run(parser.parse_args())
