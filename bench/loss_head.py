"""`loss`'s head timings: a forward and backward of the head and the loss alone, at one shape, for each way of
computing them: the plain loss eager and under `torch.compile`, parallama's fused linear cross-entropy (at each
`--head-chunk-sizes`) and torch's `F.linear_cross_entropy` where the installed torch has it.

On CUDA the shape is Llama-3.2-1B's head at 8192 tokens a step (hidden 2048, vocabulary 128256) under bf16 autocast,
the head weight fp32 as under bf16-mixed. Every arm runs in this one process on the same hidden states, weight and
labels; after `--head-warmup` untimed calls, the arms take turns for `--head-repeats` timed calls each (a drift in
load hits all of them). Peak memory is reset right before each timed call, the gradients of the last one freed:
on CUDA `max_memory_allocated` above what is allocated then, on CPU the resident set's high-water mark above it.
Each arm's loss and gradients are compared with the plain loss's in fp32 (no autocast), the gradients relative to
their largest entry.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import median, sync

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CUDA_SHAPE = {"tokens": 8192, "hidden": 2048}  # Llama-3.2-1B's head at 4 x 2048 tokens
GOALS = {"time": 1.0, "peak": 0.75}  # issue #37: fused >= 1.0x the plain loss's tokens/s, <= 0.75x its peak


def add_arguments(p) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the head timings alone")
    p.add_argument("--head-tokens", type=int, help="tokens a step (default: CUDA 8192, CPU batch x seq-len)")
    p.add_argument("--head-hidden", type=int, help="hidden size (default: CUDA 2048, CPU --hidden)")
    p.add_argument(
        "--head-dtype", choices=sorted(DTYPES), help="autocast dtype (default: CUDA bf16, CPU fp32)"
    )
    p.add_argument("--head-warmup", type=int, default=2, help="untimed calls per arm (compiles happen here)")
    p.add_argument("--head-repeats", type=int, default=5, help="timed calls per arm (>= 5 for a median)")
    p.add_argument(
        "--head-chunk-sizes",
        type=int,
        nargs="+",
        help="fused arms' loss.chunk_size (default: CUDA 2048 4096 8192, CPU --chunk-size)",
    )
    p.add_argument(
        "--plain-compiled",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the plain loss under torch.compile (default: on CUDA only; on CPU its compile takes minutes)",
    )


def settings(args) -> dict:
    """The head timings' shape and arms, their device defaults filled in."""
    cuda = args.device == "cuda"
    return {
        "device": args.device,
        "tokens": args.head_tokens or (CUDA_SHAPE["tokens"] if cuda else args.batch * args.seq_len),
        "hidden": args.head_hidden or (CUDA_SHAPE["hidden"] if cuda else args.hidden),
        "vocab": args.vocab,
        "dtype": args.head_dtype or ("bf16" if cuda else "fp32"),
        "weight_dtype": "fp32",
        "warmup": args.head_warmup,
        "repeats": args.head_repeats,
        "chunk_sizes": args.head_chunk_sizes or ([2048, 4096, 8192] if cuda else [args.chunk_size]),
        "plain_compiled": cuda if args.plain_compiled is None else args.plain_compiled,
    }


def _plain(hidden, weight, labels, *, dtype):
    from parallama.training.loss import CrossEntropy

    with torch.autocast(hidden.device.type, dtype, enabled=dtype != torch.float32):
        return CrossEntropy()(F.linear(hidden, weight), labels)  # as CausalLM.loss: the logits, then the loss


def _fused(hidden, weight, labels, *, dtype, chunk_size):
    from parallama.training.loss import CrossEntropy

    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = weight  # the parameter itself, as Llama.head hands over its lm_head
    with torch.autocast(hidden.device.type, dtype, enabled=dtype != torch.float32):
        return CrossEntropy(impl="fused", chunk_size=chunk_size).fused(hidden, head, labels)


def _torch_op(hidden, weight, labels, *, dtype, chunk_size):
    from torch.nn import LinearCrossEntropyOptions

    from parallama.tokenizer import IGNORE_INDEX

    options = LinearCrossEntropyOptions(batch_chunk_size=chunk_size, chunking_method=None)
    loss = F.linear_cross_entropy(
        hidden.to(dtype), weight.to(dtype), labels, ignore_index=IGNORE_INDEX, options=options
    )
    return loss.float()


def arms(s: dict) -> dict:
    """name: a function of (hidden, weight, labels) giving the mean loss."""
    dtype = DTYPES[s["dtype"]]
    out = {"plain": partial(_plain, dtype=dtype)}
    if s["plain_compiled"]:
        out["plain_compiled"] = torch.compile(partial(_plain, dtype=dtype))
    for c in s["chunk_sizes"]:
        out[f"fused_{c}"] = partial(_fused, dtype=dtype, chunk_size=c)
    if hasattr(F, "linear_cross_entropy"):
        out[f"torch_op_{s['chunk_sizes'][0]}"] = partial(
            _torch_op, dtype=dtype, chunk_size=s["chunk_sizes"][0]
        )
    return out


def process_memory() -> dict[str, int]:
    """VmRSS and VmHWM (peak) of this process, bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_process_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set


def _peak_since_reset(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return process_memory()["VmHWM"]


def _reset_peak(device: torch.device) -> int:
    """Resets the peak; returns what is allocated now (the baseline the peak is read against)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    reset_process_peak()
    return process_memory()["VmRSS"]


def _call(fn, hidden, weight, labels) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = fn(hidden, weight, labels)
    loss.backward()
    grads = [hidden.grad, weight.grad]
    hidden.grad = weight.grad = None
    return loss.detach(), grads


def _relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def run_head(s: dict) -> dict:
    """Each arm's median time, peak memory and distance from the fp32 plain loss, at the shape `s` gives."""
    device = torch.device(s["device"])
    torch.manual_seed(0)
    hidden = torch.randn(s["tokens"], s["hidden"], device=device, requires_grad=True)
    weight = torch.nn.Parameter(0.02 * torch.randn(s["vocab"], s["hidden"], device=device))
    labels = torch.randint(0, s["vocab"], (s["tokens"],), device=device)
    if device.type == "cuda":  # how the fused arms accumulate the head weight's gradient
        from parallama.training.fused_cross_entropy import gemm_adds_into_fp32

        s["gemm_adds_into_fp32"] = gemm_adds_into_fp32(device, DTYPES[s["dtype"]])
    functions = arms(s)
    reference = _call(partial(_plain, dtype=torch.float32), hidden, weight, labels)
    checks = {}
    for name, fn in functions.items():
        for i in range(s["warmup"]):
            loss, grads = _call(fn, hidden, weight, labels)
            if i == 0:
                checks[name] = {
                    "loss_diff": abs(loss.item() - reference[0].item()),
                    "grad_hidden_rel_diff": _relative_diff(grads[0], reference[1][0]),
                    "grad_weight_rel_diff": _relative_diff(grads[1], reference[1][1]),
                }
            del loss, grads
    del reference
    times = {name: [] for name in functions}
    peaks = {name: [] for name in functions}
    for _ in range(s["repeats"]):
        for name, fn in functions.items():
            sync(device)
            baseline = _reset_peak(device)
            start = time.perf_counter()
            loss, grads = _call(fn, hidden, weight, labels)
            sync(device)
            times[name].append(time.perf_counter() - start)
            peaks[name].append(_peak_since_reset(device) - baseline)
            del loss, grads
    results = {
        name: {"ms": 1e3 * median(times[name]), "times_ms": [1e3 * t for t in times[name]]}
        | {"peak_mb": max(peaks[name]) / 2**20}
        | checks[name]
        for name in functions
    }
    return results


def report(s: dict, results: dict) -> dict:
    """Prints the table; returns each arm's time and peak over the eager plain loss's (and its time over the
    compiled plain loss's, where that arm ran)."""
    plain, compiled = results["plain"], results.get("plain_compiled")
    print(
        f"# head + loss, forward + backward: {s['tokens']} tokens x hidden {s['hidden']} x vocab {s['vocab']}, "
        f"{s['dtype']} compute, {s['weight_dtype']} weight, {s['device']}; median of {s['repeats']}"
    )
    print(
        f"{'arm':<18}{'ms':>10}{'peak MB':>10}{'time/plain':>12}{'peak/plain':>12}"
        f"{'time/compiled':>15}{'vs fp32 grads':>15}"
    )
    ratios = {}
    for name, r in results.items():
        ratios[name] = {"time": r["ms"] / plain["ms"], "peak": r["peak_mb"] / max(plain["peak_mb"], 1e-9)}
        if compiled:
            ratios[name]["time_vs_compiled"] = r["ms"] / compiled["ms"]
        diff = max(r["grad_hidden_rel_diff"], r["grad_weight_rel_diff"])
        vs_compiled = f"{ratios[name]['time_vs_compiled']:.2f}" if compiled else "-"
        print(
            f"{name:<18}{r['ms']:>10.1f}{r['peak_mb']:>10.0f}{ratios[name]['time']:>12.2f}"
            f"{ratios[name]['peak']:>12.2f}{vs_compiled:>15}{diff:>15.1e}"
        )
    if "gemm_adds_into_fp32" in s:
        how = (
            "in the GEMM"
            if s["gemm_adds_into_fp32"]
            else "through a bf16 product (no fp32 out_dtype GEMM here)"
        )
        print(f"# the fused arms accumulate the weight's fp32 gradient {how}")
    goal = f"<= {GOALS['time']}x the plain loss's time, <= {GOALS['peak']}x its peak"
    print(f"# goal (issue #37, on CUDA): a fused arm at {goal}")
    if not hasattr(F, "linear_cross_entropy"):
        print(f"# torch {torch.__version__} has no F.linear_cross_entropy: no torch_op arm")
    return ratios
