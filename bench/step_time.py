"""Where a profiled training step's time goes, for `python -m bench train-gpu`'s arms: parallama-train's (the
Clock, bench/clock.py, profiles one step after its windows) and the plain loops' (bench/gpu.py's bare loop,
bench/titan.py's torchtitan: `profile_step`). `summary` splits the step into its parts, each forward and backward
(`StepParts`: the blocks, the head and the loss, the optimizer, clipping), the GPU kernels by kind, parallama's
named ranges and the costliest ops.
"""

from __future__ import annotations

from bisect import bisect_right

import torch
from torch.autograd import DeviceType
from torch.profiler import record_function

# Kernel names, by what they compute: a profile's device time split into these (the rest is "other").
KERNELS = {
    "attention": ("flash", "fmha", "attention", "sdpa", "cudnn"),
    "matmul": ("gemm", "nvjet", "cutlass", "xmma", "matmul", "scaled_mm", "sm90_"),
}
PARALLAMA_CLIP = "parallama.clip_gradients"  # training/module.py's range around clipping
RANGES = ("parallama.loss", PARALLAMA_CLIP)  # record_function names of parallama's own
CLIP = "bench.clip_gradients"  # the plain loops' clipping (`profile_step`)
# The parts a profiled step is split into (`StepParts`), each a range the Clock opens and closes around it.
PARTS = {"blocks": "bench.blocks", "head+loss": "bench.head+loss", "optimizer": "bench.optimizer"}
# The profiler's name for an autograd node run in backward (its sequence number: that of the op that made it).
BACKWARD = "autograd::engine::evaluate_function: "


class StepParts:
    """The ranges (`PARTS`) that split the profiled step, opened and closed from hooks, only while it is profiled:
    the blocks, from the embedding's output to the final norm; the head and the loss, from the final norm to the
    backward (Lightning's `on_before_backward`); the optimizer, from the backward's end (`on_before_optimizer_step`)
    to its step's end (the post-hook of the optimizer Lightning steps, not of one it steps inside, as Muon's AdamW
    half: the range must hold that one's whole), clipping inside it. Hooks on eager modules only (a compiled block
    would recompile for one). A range holds a part's forward; `by_part` adds the backward of the ops run in it."""

    def __init__(
        self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], embedding: str = "embed_tokens"
    ) -> None:
        self.open: dict[str, record_function] = {}
        self.hooks = [o.register_step_post_hook(lambda *_: self.close("optimizer")) for o in optimizers]
        embed, norm = getattr(model, embedding, None), getattr(model, "norm", None)
        # the layout of parallama's families and of torchtitan's Llama (a model without it: no blocks, no head)
        if embed is not None and norm is not None:
            self.hooks.append(embed.register_forward_hook(lambda *_: self.begin("blocks")))
            self.hooks.append(norm.register_forward_pre_hook(lambda *_: self.begin("head+loss")))

    def begin(self, part: str) -> None:
        if part == "head+loss":
            self.close("blocks")
        self.close(part)
        self.open[part] = record_function(PARTS[part]).__enter__()

    def close(self, part: str) -> None:
        if (opened := self.open.pop(part, None)) is not None:
            opened.__exit__(None, None, None)

    def remove(self) -> None:
        for part in list(self.open):
            self.close(part)
        for hook in self.hooks:
            hook.remove()


class Unprofiled:
    """`StepParts`' stand-in in the steps a plain loop does not profile."""

    def begin(self, part: str) -> None:
        pass

    def close(self, part: str) -> None:
        pass


UNPROFILED = Unprofiled()


def clip_and_step(parts, model: torch.nn.Module, optimizer) -> None:
    """A plain loop's step after its backward, marked as `StepParts` splits it: clipping the gradients' norm at 1.0
    (in a `CLIP` range), then the optimizer's step."""
    parts.begin("optimizer")
    with record_function(CLIP):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def profile_step(step, model: torch.nn.Module, optimizer, embedding: str = "embed_tokens") -> dict:
    """`summary` of one step of a plain loop (bench/gpu.py's, bench/titan.py's), split into the same parts as
    parallama-train's: `step(parts)` runs it, calling `parts.close("head+loss")` before its backward and
    `clip_and_step` after (given `UNPROFILED` in the other steps)."""
    cuda = next(model.parameters()).device.type == "cuda"
    activities = [
        torch.profiler.ProfilerActivity.CPU,
        *([torch.profiler.ProfilerActivity.CUDA] if cuda else []),
    ]
    with torch.profiler.profile(activities=activities) as profiler:
        parts = StepParts(model, [optimizer], embedding)
        step(parts)
        if cuda:
            torch.cuda.synchronize()
        parts.remove()
    return summary(profiler, 1)


def summary(profiler, steps: int) -> dict:
    """Where a step's time goes, per optimizer step: device (else CPU) milliseconds of its parts (`by_part`), of
    the GPU kernels by kind (`KERNELS`; none on a CPU; each kernel counted once, not again in the op that launched
    it), of parallama's named ranges (`RANGES`: the loss, clipping; a range's device time is that of the kernels
    launched inside it), and the 15 costliest ops. A `record_function` range is a CPU event whose device time is
    its kernels', and also a GPU-timeline annotation spanning them: `gpu_annotation` drops the latter, which is
    neither a kernel nor an op (counted until the H200 lease of 19:40 UTC, it put Lightning's `Optimizer.step`,
    which wraps the whole forward and backward, among the kernels as "other", and counted each range twice).
    On a CPU the parts and ranges are CPU time, any wait inside them included."""
    events = [e for e in profiler.key_averages() if not gpu_annotation(e)]
    on_device = any(getattr(e, "self_device_time_total", 0) for e in events)

    def self_ms(e) -> float:
        return (e.self_device_time_total if on_device else e.self_cpu_time_total) / 1e3 / steps

    def total_ms(e) -> float:
        return (e.device_time_total if on_device else e.cpu_time_total) / 1e3 / steps

    kinds = dict.fromkeys([*KERNELS, "other"], 0.0) if on_device else {}  # kernels run on a device only
    for e in events if on_device else []:
        if getattr(e, "device_type", None) != DeviceType.CUDA:  # an op's or a range's time is its kernels'
            continue
        name = e.key.lower()
        kinds[next((k for k, words in KERNELS.items() if any(w in name for w in words)), "other")] += self_ms(
            e
        )
    parts = by_part(profiler.events(), total_ms)
    if on_device:  # the kernels no part holds: the embedding's, the gradients' accumulation into `.grad`
        parts["other"] = sum(kinds.values()) - sum(parts.values())
    ranges = {
        r: round(sum(total_ms(e) for e in events if e.key.startswith(r)), 3)
        for r in RANGES
        if any(e.key.startswith(r) for e in events)
    }
    top = sorted(events, key=self_ms, reverse=True)[:15]
    return {
        "clock": "device" if on_device else "cpu",
        "ms_per_step_by_part": {k: round(v, 3) for k, v in parts.items()},
        "ms_per_step_by_kind": {k: round(v, 3) for k, v in kinds.items()},
        "ms_per_step_in_ranges": ranges,
        "top_ops": [{"name": e.key[:120], "calls": e.count, "self_ms": round(self_ms(e), 3)} for e in top],
    }


def by_part(events, ms) -> dict[str, float]:
    """The step's parts (`PARTS`, and clipping), forward and backward: a part's range holds its forward; its
    backward is the autograd nodes that the forward's ops made (the profiler gives an op and the node it made the
    same sequence number), each node counted once (not again where it runs inside another, as a reentrant
    checkpoint's do); the optimizer's range holds clipping, counted apart. `ms(event)`: an event's milliseconds
    per step. A part whose range never opened reads 0."""
    events = [e for e in events if not gpu_annotation(e)]
    ranges = {part: [e for e in events if e.name == name] for part, name in PARTS.items()}
    spans = sorted((e.time_range.start, e.time_range.end, e.thread, part) for part in ("blocks", "head+loss")
                   for e in ranges[part])  # fmt: skip
    starts = [span[0] for span in spans]
    made_in = {}  # (thread, sequence number) of a forward op -> the part whose range ran it
    for e in events:
        if e.sequence_nr < 0 or e.name.startswith(BACKWARD):
            continue
        i = bisect_right(starts, e.time_range.start) - 1
        if i >= 0 and e.time_range.end <= spans[i][1] and e.thread == spans[i][2]:
            made_in[(e.thread, e.sequence_nr)] = spans[i][3]
    parts = {part: sum(ms(e) for e in found) for part, found in ranges.items()}
    for e in events:
        part = made_in.get((e.fwd_thread, e.sequence_nr)) if e.name.startswith(BACKWARD) else None
        if part and not inside_backward_node(e):
            parts[part] += ms(e)
    parts["clip"] = sum(ms(e) for e in events if e.name in (PARALLAMA_CLIP, CLIP))
    if ranges["optimizer"]:  # which holds clipping
        parts["optimizer"] -= parts["clip"]
    return parts


def inside_backward_node(event) -> bool:
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(BACKWARD):
        parent = parent.cpu_parent
    return parent is not None


def gpu_annotation(event) -> bool:
    """A `record_function` range's copy on the GPU's timeline (its CPU event stays: it holds the range's kernels)."""
    return bool(getattr(event, "is_user_annotation", False)) and event.device_type != DeviceType.CPU
