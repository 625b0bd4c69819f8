"""The timer `python -m bench train-gpu` adds to each `parallama-train` run it times (`+callbacks.bench_clock`):
tokens/s in windows of whole optimizer steps after a warm-up, the peak memory from the end of the warm-up, and a
profile of the step after the last window (where the step's time goes: its parts, blocks, head + loss,
optimizer, clipping, each forward and backward; the kernels by kind; the costliest ops). Written as JSON to `path`
after every window, so an arm cut short keeps what it measured.

Windows are counted in micro-batches and closed at an optimizer step's end, so `trainer.accumulate_grad_batches`
arms are timed in whole steps (their optimizer is in the window). Only the window ends synchronize with the GPU.

`at` holds the wall-clock time (`time.time()`) the run reached each of its phases (`PHASES`), so that
bench/train_gpu.py can say where a run's seconds go beyond its windows: a 1B run took 35-70 s on the H100 and
H200 for about 5 s of timed work, and what is left decides how many arms one device call holds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch

from bench.step_time import StepParts, summary

# Where a run is when `at` stamps it: Lightning's setup (before the model is built), the fit's start (model built,
# optimizer made), the first micro-batch's end (compilation), the warm-up's end, the last window's, the profile's.
PHASES = ("setup", "fit_start", "first_batch", "warmup_end", "windows_end", "profile_end")


class Clock(L.Callback):
    """`warmup` micro-batches untimed (compilation, the optimizer's first steps: at least 2 optimizer steps), then
    `windows` windows of at least `steps` micro-batches each, then `profile` optimizer steps under torch's
    profiler; then, its results written, the process ends (`end_now`; a run of several processes is asked to stop)."""

    def __init__(self, path: str, warmup: int, steps: int, windows: int = 3, profile: int = 0) -> None:
        self.path, self.warmup, self.steps, self.windows, self.profile = path, warmup, steps, windows, profile
        self.batches, self.optimizer_steps, self.last_step = 0, 0, 0
        self.phase, self.t0, self.tokens, self.window_batches = "warmup", 0.0, 0, 0
        self.result: dict = {"rates": [], "peak_bytes": 0, "at": {}}
        self.profiler, self.parts = None, None

    def _stamp(self, phase: str) -> None:
        self.result["at"][phase] = time.time()

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._stamp("setup")

    def on_fit_start(self, trainer, pl_module) -> None:
        self._stamp("fit_start")

    def _sync(self, trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.phase == "profile" and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.strategy.root_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.parts = StepParts(pl_module.model, trainer.optimizers)
            self.profiled_from = self.optimizer_steps

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self.parts:
            self.parts.close("head+loss")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.parts:  # after the backward; clipping and the optimizer's step follow
            self.parts.begin("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches += 1
        if self.batches == 1:
            self._sync(trainer)
            self._stamp("first_batch")
        if self.phase == "timing":
            self.tokens += batch["input_ids"].numel()
            self.window_batches += 1
        stepped = trainer.global_step != self.last_step  # an optimizer step ended with this micro-batch
        self.last_step = trainer.global_step
        if not stepped:
            return
        self.optimizer_steps += 1
        if self.phase == "warmup" and self.batches >= self.warmup and self.optimizer_steps >= 2:
            self._sync(trainer)
            if torch.cuda.is_available():  # every arm's peak from the same point: the end of its warm-up
                torch.cuda.reset_peak_memory_stats()
            self._stamp("warmup_end")
            self._start_window()
        elif self.phase == "timing" and self.window_batches >= self.steps:
            self._sync(trainer)
            self.result["rates"].append(self.tokens / (time.perf_counter() - self.t0))
            self.result["peak_bytes"] = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
            if len(self.result["rates"]) < self.windows:
                self._start_window()
            else:
                self.phase = "profile" if self.profile else "done"
                self._stamp("windows_end")
            self._write(trainer)
        elif self.phase == "profile" and self.optimizer_steps - self.profiled_from >= self.profile:
            self._sync(trainer)
            self.parts.remove()
            self.profiler.__exit__(None, None, None)
            self.parts = None
            self.result["profile"] = summary(self.profiler, self.profile)
            self._stamp("profile_end")
            self.phase = "done"
            self._write(trainer)
        if self.phase == "done":
            trainer.should_stop = True
            if trainer.world_size == 1:
                end_now()

    def _start_window(self) -> None:
        self.phase, self.tokens, self.window_batches = "timing", 0, 0
        self.t0 = time.perf_counter()

    def _write(self, trainer) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.result))


def end_now() -> None:
    """The run's results written, its process ends here, with status 0: the fit's teardown, the end-of-run report
    and the interpreter's shutdown (a second and a half of a tiny CPU run; on a GPU also the CUDA context and
    the compile workers) time nothing, and every arm run of a device call pays them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
