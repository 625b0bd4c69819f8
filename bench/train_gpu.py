"""`train-gpu`: `parallama-train` itself on one GPU (the user's command, default callbacks), each lever on and off,
beside the bare loop and torchtitan 0.2.2 on the same GPU in the same call; results as JSON (bench/results/).

Arms (`PLAN`: per model, the goals' arms first; `--arms` picks some):
- `parallama-train model=<m> data.seq_len=S data.batch_size=B` as a user runs it (`default`: compile is on by
  default on CUDA; each run forked from a process with the imports done: bench/forked.py), then one lever at a
  time on top (`LEVERS`): the old default (`compile=false`), the loss, float8, activation checkpointing, the
  callbacks (`callbacks=none`: what the default ones cost), Muon against AdamW at 16 micro-batches (128k tokens)
  an optimizer step, the 1B at batch 8. Validation, the sample and the checkpoint callbacks are off (they act
  outside the timed steps); the embedded corpus, the byte tokenizer, the preset's vocabulary. Timed by
  bench/clock.py's `Clock`, added as a callback.
- the bare loop (bench/gpu.py's `measure`: the parallama model in plain PyTorch, random tokens);
- torchtitan 0.2.2 (bench/titan.py): its Llama 3 at the same widths, parallelized by itself (`TITAN`).
Models (`MODELS`): Llama-3.2-1B (seq 2048, batch 4), the 180M (seq 512, batch 64: the article's global batch as one
micro-batch) and an 8B-shaped model (Llama 3 8B's widths, 4 layers, seq 8192, batch 1), where float8's
published gains are claimed.

Fairness: every arm runs `--rounds` times, the arms interleaved (round 1 in `PLAN`'s order, later rounds
rotated), each run `--windows` timed windows after its warm-up: tokens/s is the median of all its windows, with
their spread; its peak memory is reset at the same point (the end of the warm-up); its first run profiles one
step after its windows (bench/step_time.py `summary`: where the step's time goes); every parallama-train run says
where its own seconds went (`timeline_s`: start, model, compilation, warm-up, windows, profile, exit). Each result
names the torch version it ran on. MFU = `LlamaConfig.flops_per_token(seq_len)` x tokens/s / the GPU's dense bf16
peak, for every arm.

`--dry-run`: the arms once on a CPU at tiny sizes (no compile, torchtitan skipped with its reason: it needs
CUDA); its timings mean nothing. On the GPU machines: bench/gpu_run.sh (installs bench/gpu_wheels.sh's wheels
offline, then runs this).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from bench.common import ROOT, free_port, machine, print_machine, save
from bench.forked import Forks, child, last_lines, start

MODELS = {  # name: (parallama-train overrides, seq_len, micro-batch)
    "llama3_2_1b": (["model=llama3_2_1b"], 2048, 4),
    "llama_180m": (["model=llama_180m"], 512, 64),
    "llama3_8b_4l": (["model=llama3_8b", "model.num_hidden_layers=4"], 8192, 1),
}
DRY_MODELS = {"tiny": (["model=tiny"], 64, 2)}
# a candidate before it is a setting (bench/levers.py)
RESIDUAL = "+callbacks.bench_residual._target_=bench.levers.ResidualInComputeDtype"
LEVERS = {  # arm -> overrides on top of the user's command
    "default": [],
    "compile=false": ["compile=false"],
    "loss.impl=fused": ["loss.impl=fused"],
    "loss.impl=plain": ["loss.impl=plain"],
    "float8=tensorwise": ["float8=tensorwise"],
    "float8=rowwise": ["float8=rowwise"],
    "ac=selective": ["activation_checkpointing=selective"],
    "callbacks=none": ["callbacks=none"],
    "data.batch_size=8": ["data.batch_size=8"],
    "pad_vocab_multiple=64": ["model.pad_vocab_multiple=64"],
    "accumulate=16": ["trainer.accumulate_grad_batches=16"],
    "optimizer=muon accumulate=16": ["optimizer=muon", "trainer.accumulate_grad_batches=16"],
    "muon standard accumulate=16": [
        "optimizer=muon",
        "optimizer.ns_method=standard",
        "trainer.accumulate_grad_batches=16",
    ],
    "residual=bf16": [RESIDUAL],
    "float8=tensorwise residual=bf16": ["float8=tensorwise", RESIDUAL],  # the best setting, were it adopted
}
TITAN = {  # torchtitan arms (bench/titan.py); "best": what the issue names its best settings
    "titan best": {"compile": True, "ac": "selective", "float8": "tensorwise"},
    "titan compile": {"compile": True, "ac": "none", "float8": None},
}
BARE = {"bare compile": True, "bare eager": False}
PLAN = {  # per model, in the order round 1 runs them
    "llama3_2_1b": [
        "default", "titan best", "loss.impl=fused", "float8=tensorwise", "compile=false",
        "titan compile", "optimizer=muon accumulate=16", "muon standard accumulate=16", "accumulate=16",
        "float8=rowwise", "ac=selective",
        "callbacks=none", "data.batch_size=8", "residual=bf16", "float8=tensorwise residual=bf16", "bare compile",
    ],
    "llama_180m": ["default", "compile=false", "pad_vocab_multiple=64", "loss.impl=fused", "float8=tensorwise"],
    "llama3_8b_4l": ["default", "float8=tensorwise"],
    "tiny": ["default", "loss.impl=fused", "callbacks=none", "accumulate=16", "bare eager", "titan compile"],
}  # fmt: skip


def shape(model: str) -> tuple[list[str], int, int]:
    return {**MODELS, **DRY_MODELS}[model]


def command(model: str, lever: list[str], args, run_dir: Path, out: Path, profile: int) -> list[str]:
    """The `parallama-train` command of one run of an arm (its Clock writes `out`)."""
    overrides, seq_len, batch = shape(model)
    batch = next((int(o.split("=")[1]) for o in lever if o.startswith("data.batch_size=")), batch)
    lever = [o for o in lever if not o.startswith("data.batch_size=")]
    accumulate = next((int(o.split("=")[1]) for o in lever if o.startswith("trainer.accumulate")), 1)
    optimizer_steps = max(2, -(-args.warmup // accumulate)) + args.windows * -(-args.steps // accumulate)
    line = [
        sys.executable, "-m", "parallama.cli.train", *overrides,
        f"data.seq_len={seq_len}", f"data.batch_size={batch}", f"trainer.max_steps={optimizer_steps + profile + 2}",
        "trainer.limit_val_batches=0", "validate_before_training=false", "sample.max_new_tokens=0",
        f"paths.cache_dir={args.cache_dir}", f"hydra.run.dir={run_dir}", *lever,
    ]  # fmt: skip
    if "callbacks=none" not in lever:
        line += ["~callbacks.last_checkpoint", "~callbacks.model_checkpoint"]
    clock = {"_target_": "bench.clock.Clock", "path": out, "warmup": args.warmup, "steps": args.steps}
    clock.update(windows=args.windows, profile=profile)
    line += [f"+callbacks.bench_clock.{k}={v}" for k, v in clock.items()]
    return line + (["trainer.accelerator=cpu"] if args.dry_run else [])


def train_run(
    model: str, lever: list[str], args, tmp: Path, name: str, timeout: float, profile: int, fork: bool
) -> dict:
    """One `parallama-train` run of an arm, forked (bench/forked.py) or afresh: its Clock's windows, or the error's
    last lines."""
    out = tmp / f"{name}.json"
    out.unlink(missing_ok=True)
    line = command(model, lever, args, tmp / name, out, profile)
    launched = time.time()
    proc = start(line, timeout, fork)
    found = clock_file(out)
    found["timeline_s"] = timeline(launched, found.pop("at", {}), time.time())  # also how far a cut run got
    if proc is None:
        return {**found, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not found.get("rates"):
        return {**found, "error": last_lines(proc)}
    return found


def clock_file(path: Path) -> dict:
    """What a run's Clock wrote: {} where it wrote nothing, or where the run was killed in the middle of a write."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def timeline(launched: float, at: dict[str, float], ended: float) -> dict[str, float]:
    """Where a run's seconds went, phase by phase (bench/clock.py `PHASES`, those the run reached, in the order it
    reached them), from its launch to its process's end: each entry the seconds since the one before."""
    marks = [("launch", launched), *sorted(at.items(), key=lambda mark: mark[1]), ("exit", ended)]
    return {f"{a}-{b}": round(t1 - t0, 2) for (a, t0), (b, t1) in zip(marks, marks[1:])}


def bare(model: str, compile: bool, args) -> None:
    """The bare loop's arm (run by `child`): bench/gpu.py's `measure` on the preset."""
    from bench.common import preset
    from bench.gpu import measure

    overrides, seq_len, batch = shape(model)
    cfg = preset(overrides[0].split("=")[1], 320)  # 320: the byte tokenizer's, as parallama-train
    cfg.update(model_fields(overrides))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loop = type("Loop", (), {"warmup": args.warmup, "steps": args.steps, "repeats": args.windows})
    variant = {"compile": compile and not args.dry_run}
    rates, peak, profile = measure(cfg, seq_len, batch, variant, device, loop, profile=bool(args.profile))
    found = {"rates": rates, "peak_bytes": peak, **({"profile": profile} if profile else {})}
    print("RESULT " + json.dumps(found), flush=True)


def model_fields(overrides: list[str]) -> dict:
    """The `model.<field>=<value>` overrides of a model's command, as fields."""
    fields = {}
    for o in overrides:
        if o.startswith("model."):
            key, value = o[len("model.") :].split("=", 1)
            fields[key] = int(value) if value.isdigit() else value
    return fields


def arm_run(model: str, name: str, args, tmp: Path, timeout: float, profile: int, forks: Forks) -> dict:
    """One run of an arm, whatever runs it."""
    if name in BARE:
        dry = ["--dry-run"] if args.dry_run else []
        steps = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--windows", str(args.windows)]
        steps += ["--profile", str(profile)]
        compile = ["--compile"] if BARE[name] else []
        return forks.run(
            lambda fork: child(["bench.train_gpu", "--bare", model, *compile, *steps, *dry], timeout, fork)
        )
    if name in TITAN:
        if args.dry_run or not torch.cuda.is_available():
            return {"skipped": "torchtitan builds its model on CUDA (no CPU path) and imports triton"}
        _, seq_len, batch = shape(model)
        arm = {"shape": model, "seq_len": seq_len, "batch": batch, **TITAN[name], "warmup": args.warmup}
        arm.update(steps=args.steps, windows=args.windows, profile=profile, port=free_port())
        return forks.run(lambda fork: child(["bench.titan", json.dumps(arm)], timeout, fork))
    slug = name.replace("=", "-").replace(" ", "_")
    return forks.run(
        lambda fork: train_run(model, LEVERS[name], args, tmp, f"{model}-{slug}", timeout, profile, fork)
    )


def schedule(args) -> list[tuple[int, str, str]]:
    """(round, model, arm) in the order they run: round 1 in PLAN's order, each later round rotated by one more
    arm, so that no arm always runs first or right after the same one."""
    plan = {m: planned(args.arms, m) for m in run_models(args)}
    order = []
    for r in range(args.rounds):
        for m, arms in plan.items():
            k = r % len(arms) if arms else 0
            order += [(r, m, a) for a in arms[k:] + arms[:k]]
    return order


def run_models(args) -> list[str]:
    return list(DRY_MODELS) if args.dry_run else args.models


def planned(arms: list[str] | None, model: str) -> list[str]:
    """The arms of `model` that `--arms` names, for every model (`default`) or for this one (`llama_180m:default`):
    PLAN's, in its order, then those PLAN lacks for the model, in `--arms`' order. No `--arms`: PLAN's."""
    if not arms:
        return PLAN[model]
    asked = [a.split(":", 1)[-1] for a in arms if ":" not in a or a.startswith(f"{model}:")]
    return [a for a in PLAN[model] if a in asked] + [a for a in dict.fromkeys(asked) if a not in PLAN[model]]


def summarize_arm(runs: list[dict]) -> dict:
    """An arm's runs as one row: the median of all its windows, their spread, the highest peak."""
    rates = [r for run in runs for r in run.get("rates", [])]
    row = {"runs": runs, "torch": torch.__version__}
    if rates:
        row.update(tokens_per_s=statistics.median(rates), windows=len(rates))
        row["spread"] = [min(rates), max(rates)]
        row["peak_bytes"] = max(run.get("peak_bytes", 0) for run in runs)
    else:
        row["error"] = next((r.get("error") or r.get("skipped") for r in runs), None)
    return row


def flops_per_token(model: str) -> float:
    from parallama.models.llama.config import LlamaConfig

    overrides, seq_len, _ = shape(model)
    name = overrides[0].split("=")[1]
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"), resolve=True)
    cfg.pop("family")
    cfg.update(model_fields(overrides), vocab_size=cfg["vocab_size"] or 320)
    return LlamaConfig(**cfg).flops_per_token(seq_len)


RATIOS = {  # label: (arm, its reference); each as tokens/s and as peak memory
    "default / compile=false (what the new default bought)": ("default", "compile=false"),
    "default / titan best": ("default", "titan best"),
    "float8=tensorwise / titan best (the best shipped settings)": ("float8=tensorwise", "titan best"),
    "default / titan compile": ("default", "titan compile"),
    "loss.impl=fused / default": ("loss.impl=fused", "default"),
    "loss.impl=plain / default": ("loss.impl=plain", "default"),
    "float8=tensorwise / default": ("float8=tensorwise", "default"),
    "float8=rowwise / default": ("float8=rowwise", "default"),
    "ac=selective / default": ("ac=selective", "default"),
    "default callbacks' cost (1 - default / callbacks=none)": ("default", "callbacks=none"),
    "optimizer=muon / adamw, both accumulate=16": ("optimizer=muon accumulate=16", "accumulate=16"),
    "muon standard / adamw, both accumulate=16": ("muon standard accumulate=16", "accumulate=16"),
    "default / bare compile": ("default", "bare compile"),
    "data.batch_size=8 / default": ("data.batch_size=8", "default"),
    "pad_vocab_multiple=64 / default (vocabulary as it is)": ("pad_vocab_multiple=64", "default"),
    "residual=bf16 / default (bench/levers.py)": ("residual=bf16", "default"),
    "float8=tensorwise residual=bf16 / float8=tensorwise": (
        "float8=tensorwise residual=bf16",
        "float8=tensorwise",
    ),
}


def summarize(results: dict, peak_flops: float | None) -> dict:
    """MFU per arm, and the ratios the issue's goals are stated in (tokens/s, and peak memory)."""
    ratios = {}
    for model, rows in results.items():
        flops = flops_per_token(model)
        for row in rows.values():
            if row.get("tokens_per_s"):
                row["peak_gib"] = row["peak_bytes"] / 2**30
                row["mfu"] = flops * row["tokens_per_s"] / peak_flops if peak_flops else None
        ratios[model] = {}
        for label, (a, b) in RATIOS.items():
            ra, rb = rows.get(a, {}), rows.get(b, {})
            if ra.get("tokens_per_s") and rb.get("tokens_per_s"):
                value = ra["tokens_per_s"] / rb["tokens_per_s"]
                ratios[model][label] = round(1 - value if "cost" in label else value, 4)
                if ra.get("peak_bytes") and rb.get("peak_bytes") and "cost" not in label:
                    ratios[model][f"{label}, peak memory"] = round(ra["peak_bytes"] / rb["peak_bytes"], 4)
    return ratios


def check_arms(args) -> None:
    """`--arms` names known arms, for models the call runs: one line before any run (a typo in bench/gpu_run.sh
    would cost a device lease)."""
    known = {*LEVERS, *TITAN, *BARE}
    if args.arms and (unknown := {a.split(":", 1)[-1] for a in args.arms} - known):
        raise SystemExit(f"--arms: unknown {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    models = run_models(args)
    if args.arms and (stray := sorted({a.split(":", 1)[0] for a in args.arms if ":" in a} - set(models))):
        raise SystemExit(f"--arms: {', '.join(stray)} is not among the models run ({', '.join(models)})")


def run(args) -> dict:
    if args.bare:
        bare(args.bare, args.compile, args)
        return {}
    check_arms(args)
    from bench.gpu import peak_flops

    info = machine()
    print_machine(info)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: train-gpu needs one (--dry-run runs every arm once on this CPU)")
        return {}
    peak = None if args.dry_run else peak_flops(torch.device("cuda"))
    runs: dict = {}
    forks = Forks(args.fork)
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for r, model, name in schedule(args):
            left = args.budget_s - (time.monotonic() - began)
            done = runs.setdefault(model, {}).setdefault(name, [])
            if left < args.min_arm_s:
                done.append({"skipped": f"round {r + 1}: time budget, {left:.0f} s of --budget-s left"})
                continue
            if any("error" in d or "skipped" in d for d in done):
                continue  # an arm that failed once is not retried
            t0 = time.monotonic()
            timeout, profile = min(left, args.arm_timeout_s), int(r == 0) * args.profile
            result = arm_run(model, name, args, Path(tmp), timeout, profile, forks)
            result["seconds"] = round(time.monotonic() - t0, 1)
            done.append(result)
            shown = result.get("rates") or result.get("skipped") or result.get("error")
            print(f"round {r + 1} {model:13s} {name:30s} {result['seconds']:6.1f} s  {shown}", flush=True)
            rows = {m: {a: summarize_arm(x) for a, x in arms.items()} for m, arms in runs.items()}
            save(args.out, "train-gpu", info, {"results": rows, "dry_run": args.dry_run})
    results = {m: {a: summarize_arm(x) for a, x in arms.items()} for m, arms in runs.items()}
    out = {"results": results, "ratios": summarize(results, peak), "dry_run": args.dry_run}
    out["notes"] = [
        "timings of a --dry-run (CPU, tiny sizes) mean nothing" if args.dry_run else
        f"tokens/s per GPU: median of {args.rounds} interleaved runs x {args.windows} windows of >= {args.steps} "
        f"micro-batches after {args.warmup}; peak memory from the end of each run's warm-up",
        "arm runs forked from a process with torch, Lightning and Hydra imported (bench/forked.py): "
        "timeline_s's launch-setup holds no imports but the first run's" if forks.on else
        "arm runs started afresh (their launch-setup holds the imports)",
    ] + ([forks.note] if forks.note else [])  # fmt: skip
    save(args.out, "train-gpu", info, out)
    print(json.dumps(out["ratios"], indent=2))
    return out


def add_arguments(p) -> None:
    p.add_argument("--models", nargs="+", default=["llama3_2_1b"], choices=list(MODELS))
    p.add_argument("--warmup", type=int, default=6, help="untimed micro-batches (compilation happens there)")
    p.add_argument(
        "--steps", type=int, default=8, help="micro-batches per timed window (whole optimizer steps)"
    )
    p.add_argument("--windows", type=int, default=3, help="timed windows per run of an arm")
    p.add_argument("--rounds", type=int, default=2, help="runs per arm, interleaved with the other arms'")
    p.add_argument("--profile", type=int, default=1, help="optimizer steps profiled after an arm's first run")
    p.add_argument("--budget-s", type=float, default=480, help="runs that would start later are skipped")
    p.add_argument("--min-arm-s", type=float, default=30, help="a run starts only with this much budget left")
    p.add_argument("--arm-timeout-s", type=float, default=150, help="one run's limit")
    p.add_argument(
        "--dry-run", action="store_true", help="the arms once on CPU, tiny sizes (checks the script)"
    )
    p.add_argument(
        "--fork",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fork the arms' runs from a process with the imports done (bench/forked.py)",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        help="only these arms (as in the results), e.g. default 'llama_180m:compile=false'; one PLAN lacks for a "
        "model runs after PLAN's",
    )
    p.add_argument("--bare", help=argparse.SUPPRESS, default=None)  # a bare-loop arm's child process
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)


if __name__ == "__main__":  # a bare-loop arm: python -m bench.train_gpu --bare <model> [--compile]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--cache-dir", default="data/cache")
    parser.add_argument("--out")
    run(parser.parse_args())
