"""`loss`: the fused linear cross-entropy (`loss.impl=fused`) against the plain loss: a training step's time and
peak memory at Llama 3's vocabulary (128256), and the weights after the same steps (CPU); and the head and loss alone
timed every way they can be computed (bench/loss_head.py; `--device cuda`: those alone, at Llama-3.2-1B's head).

Each variant trains in a process of its own (spawned: no memory of the other's), on the same weights and batches:
a small Llama (the head and embedding dominate, as the logits do) with AdamW, its forward, loss and backward as
`CausalLM.loss` runs them. The peak is Linux's resident-set high-water mark (VmHWM), reset after the first step
(which allocates AdamW's state) so that it is the peak of the measured steps; the step's own memory is that peak
minus the resident set before it (weights, gradients, optimizer state: the same in both). torch's CPU allocations
are plain malloc/mmap, so the resident set sees them (tracemalloc would not).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import torch

from bench import loss_head
from bench.common import machine, median, print_machine, save

VARIANTS = ("plain", "fused")
GOAL_PEAK_RATIO = 0.6  # issue #28: fused step peak <= 0.6 x plain's
GOAL_WEIGHTS = 1e-5
OPTIMIZERS = {  # name: (class, lr)
    "adamw": (torch.optim.AdamW, 1e-3),
    "sgd": (torch.optim.SGD, 0.5),
}


def add_arguments(p) -> None:
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary size (Llama 3's)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the small Llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="training steps; the first is not timed")
    p.add_argument("--chunk-size", type=int, default=1024, help="loss.chunk_size: tokens per chunk")
    p.add_argument("--repeats", type=int, default=1, help="rounds of both variants (ratios: their medians)")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="of both variants' loss")
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adamw",
        help="adamw (the recipe's) or sgd (an update linear in the gradient: see docs/benchmarks.md)",
    )
    loss_head.add_arguments(p)


def _model(args: dict):
    from parallama.models.llama.config import LlamaConfig
    from parallama.models.llama.model import Llama

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args["vocab"],
        hidden_size=args["hidden"],
        intermediate_size=4 * args["hidden"],
        num_hidden_layers=args["layers"],
        num_attention_heads=max(1, args["hidden"] // 64),
        num_key_value_heads=max(1, args["hidden"] // 64),
        max_position_embeddings=args["seq_len"],
    )
    return Llama(config)


def _initial_weights(args: dict) -> dict:
    return {k: v.clone() for k, v in _model(args).state_dict().items()}


def _variant(impl: str, args: dict, weights_path: str, queue) -> None:
    """One variant's steps in this (spawned) process; puts its figures on `queue`, saves its weights."""
    from parallama.training.loss import CrossEntropy

    model = _model(args)
    loss_fn = CrossEntropy(label_smoothing=args["label_smoothing"], impl=impl, chunk_size=args["chunk_size"])
    optimizer_class, lr = OPTIMIZERS[args["optimizer"]]
    optimizer = optimizer_class(model.parameters(), lr=lr)
    shape = (args["batch"], args["seq_len"])
    batches = [
        (torch.randint(0, args["vocab"], shape), torch.randint(0, args["vocab"], shape))
        for _ in range(args["steps"])
    ]
    times, peaks, step_peaks, losses = [], [], [], []
    for step, (ids, labels) in enumerate(batches):
        before = loss_head.process_memory()["VmRSS"]
        loss_head.reset_process_peak()
        start = time.perf_counter()
        if loss_fn.fuses():  # as CausalLM.loss
            loss = model.head(model(ids, hidden_states=True), loss_fn.head_loss(labels))
        else:
            loss = loss_fn(model(ids), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        peak = loss_head.process_memory()["VmHWM"]
        losses.append(loss.item())
        if step:  # the first step allocates AdamW's state
            times.append(elapsed)
            peaks.append(peak)
            step_peaks.append(peak - before)
    torch.save(model.state_dict(), weights_path)
    queue.put(
        {
            "step_s": median(times),
            "peak_rss_mb": max(peaks) / 2**20,
            "step_peak_mb": max(step_peaks) / 2**20,
            "losses": losses,
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        }
    )


def _interleaved_times(args: dict, queue) -> None:
    """fused / plain time of a forward and backward on one model, the two alternating step by step in this one
    process (a load that drifts between processes cancels out): the median of `args["steps"]` such ratios."""
    from parallama.training.loss import CrossEntropy

    model = _model(args)
    shape = (args["batch"], args["seq_len"])
    ids, labels = torch.randint(0, args["vocab"], shape), torch.randint(0, args["vocab"], shape)
    ratios = []
    for _ in range(args["steps"]):
        seconds = {}
        for impl in VARIANTS:
            loss_fn = CrossEntropy(
                label_smoothing=args["label_smoothing"], impl=impl, chunk_size=args["chunk_size"]
            )
            start = time.perf_counter()
            if loss_fn.fuses():
                loss = model.head(model(ids, hidden_states=True), loss_fn.head_loss(labels))
            else:
                loss = loss_fn(model(ids), labels)
            loss.backward()
            model.zero_grad(set_to_none=True)
            seconds[impl] = time.perf_counter() - start
        ratios.append(seconds["fused"] / seconds["plain"])
    queue.put(ratios)


def _ratio(fused: float, plain: float) -> float:
    """fused / plain; a tiny run's step may raise no high-water mark at all (0 MB in both: even)."""
    if plain:
        return fused / plain
    return 1.0 if not fused else math.inf


def _spawned(ctx, target, *args):
    """`target(*args, queue)` in a spawned process: what it put on the queue."""
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    proc.join()
    if proc.exitcode:
        raise RuntimeError(f"bench loss: {target.__name__}{args[:1]} failed (exit code {proc.exitcode})")
    return queue.get()


def run(args) -> None:
    info = machine()
    print_machine(info)
    head_settings = loss_head.settings(args)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench loss: --device cuda, but torch sees no CUDA device")
        head = _head(head_settings)
        save(args.out, "loss", info, {"head": head})
        return
    if args.steps < 2:
        raise SystemExit("bench loss: --steps must be >= 2 (the first step is not measured)")
    results = _steps(args)
    save(args.out, "loss", info, {**results, "head": _head(head_settings)})


def _head(settings: dict) -> dict:
    start = time.perf_counter()
    results = loss_head.run_head(settings)
    ratios = loss_head.report(settings, results)
    wall = time.perf_counter() - start  # compiles included: the GPU call's budget
    print(f"# head timings took {wall:.0f} s")
    return {
        "settings": settings,
        "results": results,
        "ratios": ratios,
        "goals": loss_head.GOALS,
        "wall_s": wall,
    }


def _steps(args) -> dict:
    """The training steps of each variant in its own process, and their forward+backward interleaved."""
    import torch.multiprocessing as mp

    settings = {k: getattr(args, k) for k in ("vocab", "seq_len", "batch", "hidden", "layers", "steps")}
    settings |= {
        "chunk_size": args.chunk_size,
        "label_smoothing": args.label_smoothing,
        "optimizer": args.optimizer,
    }
    ctx = mp.get_context("spawn")
    rounds: list[dict] = []  # per round: impl -> its figures
    weights = {}
    initial = _initial_weights(settings)
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # the variants alternate, so that a drift in load hits both
            rounds.append({})
            for impl in VARIANTS:
                path = str(Path(tmp) / f"{impl}.pt")
                rounds[-1][impl] = _spawned(ctx, _variant, impl, settings, path)
                weights[impl] = torch.load(path)
    interleaved = _spawned(ctx, _interleaved_times, settings)
    diff = max((weights["fused"][k] - weights["plain"][k]).abs().max().item() for k in weights["plain"])
    # how far training moved the weights: a check to 1e-5 says something only when this is far larger
    moved = max((weights["plain"][k] - initial[k]).abs().max().item() for k in initial)
    results = {
        impl: {**rounds[0][impl], "step_s": median([r[impl]["step_s"] for r in rounds])} for impl in VARIANTS
    }
    plain = results["plain"]
    ratios = {
        "step_peak": median([_ratio(r["fused"]["step_peak_mb"], r["plain"]["step_peak_mb"]) for r in rounds]),
        "peak_rss": median([_ratio(r["fused"]["peak_rss_mb"], r["plain"]["peak_rss_mb"]) for r in rounds]),
        "step_time": median([_ratio(r["fused"]["step_s"], r["plain"]["step_s"]) for r in rounds]),
        "forward_backward_time_interleaved": median(interleaved),
    }
    print(f"# {settings}; model {plain['params_m']:.1f} M parameters, fp32")
    print(f"{'impl':<8}{'step s':>10}{'step peak MB':>15}{'peak RSS MB':>14}  losses")
    for impl in VARIANTS:
        r = results[impl]
        losses = " ".join(f"{x:.5f}" for x in r["losses"])
        print(f"{impl:<8}{r['step_s']:>10.3f}{r['step_peak_mb']:>15.0f}{r['peak_rss_mb']:>14.0f}  {losses}")
    print(
        f"fused / plain: step peak {ratios['step_peak']:.2f}x (goal <= {GOAL_PEAK_RATIO}), process peak "
        f"{ratios['peak_rss']:.2f}x, step time {ratios['step_time']:.2f}x (forward+backward, interleaved in one "
        f"process: {ratios['forward_backward_time_interleaved']:.2f}x); weights after {args.steps} steps "
        f"differ by {diff:.1e} (goal <= {GOAL_WEIGHTS}; training moved them by up to {moved:.1e})"
    )
    goals = {"step_peak_ratio": GOAL_PEAK_RATIO, "weights_max_abs_diff": GOAL_WEIGHTS}
    return {
        "settings": settings,
        "results": results,
        "rounds": rounds,
        "interleaved_time_ratios": interleaved,
        "ratios": ratios,
        "weights_max_abs_diff": diff,
        "weights_max_abs_change": moved,
        "goals": goals,
    }
