"""`optim-step`: one `optimizer.step()` over Llama-3.2-1B's parameters (conf/model/llama3_2_1b.yaml, fp32 as
parallama-train keeps them, random gradients) on one CUDA GPU, for four optimizers built from their conf files
as parallama-train builds them on a GPU:

- `adamw`: optimizer=adamw (`fused: null` resolves to torch's fused AdamW);
- `muon`: optimizer=muon (training/muon.py: batched, compiled Newton-Schulz, by default on the Gram matrix;
  `adamw_fused: null` resolves to a fused AdamW side);
- `muon_standard`: optimizer=muon optimizer.ns_method=standard (torch.optim.Muon's iteration on X itself);
- `muon_one_by_one`: what optimizer=muon ran before: torch.optim.Muon's per-matrix loop on the blocks' matrices
  and torch's default (foreach) AdamW on the rest, which the old MuonAdamW equalled bit for bit.

The median (and the spread) of --repeats timed steps per arm, after --warmup steps (torch.compile builds its
kernels in the first) and a synchronize. `--dry-run` runs a tiny Llama on the CPU in seconds (the suite's smoke
test); without CUDA nothing else runs: a CPU timing is not the GPU's.
"""

from __future__ import annotations

import inspect
import statistics
import time

import torch
from omegaconf import OmegaConf

from bench.common import ROOT, machine, median, preset, print_machine, save, sync

ARMS = ("adamw", "muon", "muon_standard", "muon_one_by_one")
VARIANTS = {"muon_standard": ("muon", {"ns_method": "standard"})}  # arm: (conf file, keys over it)


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        default="llama3_2_1b",
        help="a conf/model preset (vocab_size null: 256, the byte tokenizer's)",
    )
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per arm (the compile happens here)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per arm: the median is reported")
    p.add_argument(
        "--dry-run", action="store_true", help="the tiny model on the CPU: a smoke test, not a figure"
    )


def optimizer_config(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "optimizer" / f"{name}.yaml"))


def build(arm: str, model, on_gpu: bool):
    """`arm`'s optimizer over `model`'s parameter groups (CausalLM.param_groups: no decay on vectors)."""
    from parallama.training.muon import mark_hidden_matrices
    from parallama.training.optim import optimizer_factory, with_fused_default

    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    if arm == "muon_one_by_one":
        return OneByOne(model, groups, optimizer_config("muon"))
    name, keys = VARIANTS.get(arm, (arm, {}))
    factory = with_fused_default(
        optimizer_factory({**optimizer_config(name), **keys}), on_gpu=on_gpu, loss_scaled=False, clipping=True
    )
    if getattr(factory.func, "takes_hidden_matrices", False):
        groups = mark_hidden_matrices(groups, model)
    return factory(groups)


class OneByOne:
    """torch.optim.Muon on the blocks' matrices, torch's default AdamW on the rest: the old MuonAdamW's step."""

    def __init__(self, model, groups: list[dict], config: dict) -> None:
        from parallama.training.muon import hidden_matrices

        hidden = hidden_matrices(model)
        ids = {id(p) for p in hidden}
        self.muon = torch.optim.Muon(
            hidden,
            lr=config["lr"],
            weight_decay=config["weight_decay"],
            momentum=config["momentum"],
            nesterov=config["nesterov"],
            ns_steps=config["ns_steps"],
            adjust_lr_fn=config["adjust_lr"],
        )
        rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
        self.adamw = torch.optim.AdamW(
            [g for g in rest if g["params"]],
            lr=config["adamw_lr"] or config["lr"],
            betas=tuple(config["adamw_betas"]),
            eps=config["adamw_eps"],
            weight_decay=config["adamw_weight_decay"],
        )

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()


def time_arm(arm: str, model, device: torch.device, args) -> dict:
    optimizer = build(arm, model, device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.warmup):
        optimizer.step()
    sync(device)
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        optimizer.step()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    del optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "step_ms": median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "max_ms": max(times) * 1e3,
        "stdev_ms": statistics.stdev(times) * 1e3 if len(times) > 1 else 0.0,
        "warmup_s": warmup_s,
        "peak_gib": peak,
    }


def accuracy(matrices, device: torch.device, steps: int) -> dict:
    """How far each method's iteration, run as the optimizer runs it (`orthogonalize`: bf16, compiled on CUDA), lands
    from the fp32 standard iteration, per distinct shape of `matrices` (random updates of that shape): the largest
    absolute error, whose ratio gram / standard the CPU test bounds at 3 (test_muon)."""
    from parallama.training.newton_schulz import orthogonalize

    defaults = inspect.signature(torch.optim.Muon).parameters  # MuonAdamW's groups take torch's
    coefficients, eps = defaults["ns_coefficients"].default, defaults["eps"].default
    generator = torch.Generator(device).manual_seed(0)
    shapes = sorted({tuple(p.shape) for p in matrices})
    errors = {}
    for shape in shapes:
        updates = [torch.randn(shape, device=device, generator=generator) for _ in range(2)]
        exact = orthogonalize(updates, coefficients, steps, eps, torch.float32, method="standard")
        row = {}
        for method in ("standard", "gram"):
            result = orthogonalize(updates, coefficients, steps, eps, torch.bfloat16, method=method)
            row[method] = max((r.float() - e).abs().max().item() for r, e in zip(result, exact))
        row["gram / standard"] = row["gram"] / row["standard"]
        errors["x".join(map(str, shape))] = row
    return errors


def run(args) -> dict:
    from parallama.models.llama.config import LlamaConfig
    from parallama.models.llama.model import Llama
    from parallama.training.muon import hidden_matrices
    from parallama.training.newton_schulz import iteration_flops

    if args.dry_run:
        args.model, device = "tiny", torch.device("cpu")
        args.warmup, args.repeats = min(args.warmup, 1), min(args.repeats, 2)  # a smoke test: 2 give a spread
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("optim-step: no CUDA device here; on a CPU run it with --dry-run (a tiny model)")
    info = machine()
    print_machine(info)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(LlamaConfig(**preset(args.model, 256)))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    matrices = hidden_matrices(model)
    ns_steps = optimizer_config("muon")["ns_steps"]
    ns_flops = sum(iteration_flops(*p.shape, ns_steps) for p in matrices)
    gram_flops = sum(iteration_flops(*p.shape, ns_steps, "gram") for p in matrices)
    print(
        f"# {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{len(matrices)} Muon matrices ({ns_flops / 1e12:.2f} TFLOP of Newton-Schulz per step, "
        f"{gram_flops / 1e12:.2f} by the Gram matrix), on {device}"
    )
    errors = accuracy(matrices, device, ns_steps)
    for shape, row in errors.items():
        print(
            f"# {shape}: largest error against fp32, bf16 standard {row['standard']:.4f}, gram {row['gram']:.4f} "
            f"({row['gram / standard']:.2f}x)"
        )
    results = {}
    for arm in ARMS:
        results[arm] = time_arm(arm, model, device, args)
        r = results[arm]
        print(
            f"{arm:>16}: {r['step_ms']:8.2f} ms per step (min {r['min_ms']:.2f}, max {r['max_ms']:.2f}; "
            f"warm-up {r['warmup_s']:.1f} s)" + (f", peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] else "")
        )
    adamw = results["adamw"]["step_ms"]
    ratios = {arm: results[arm]["step_ms"] / adamw for arm in ARMS}
    speedup = results["muon_one_by_one"]["step_ms"] / results["muon"]["step_ms"]
    print(
        f"# muon / adamw: {ratios['muon']:.2f}x; muon_standard / adamw: {ratios['muon_standard']:.2f}x; "
        f"muon_one_by_one / adamw: {ratios['muon_one_by_one']:.2f}x"
    )
    print(f"# muon is {speedup:.2f}x faster than the one-by-one loop")
    out = {
        "model": args.model,
        "device": str(device),
        "dry_run": args.dry_run,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "muon_matrices": len(matrices),
        "newton_schulz_tflop": ns_flops / 1e12,
        "gram_newton_schulz_tflop": gram_flops / 1e12,
        "bf16_error_against_fp32": errors,
        "results": results,
        "ratios_to_adamw": ratios,
        "muon_speedup_over_one_by_one": speedup,
    }
    save(args.out, "optim-step", info, out)
    return out
