"""Learning-rate schedules (conf/scheduler/): each a dataclass of its keys, checked when built, whose
`lr_lambda(total_steps)` gives the multiplier of the peak LR (`optimizer.lr`) at each optimizer step, for torch's
`LambdaLR`. A schedule of your own is a class with that method, named by `scheduler._target_` (docs/customize.md).

The multiplier is a `functools.partial` of a plain function: LambdaLR's checkpoint then stores nothing of it, so a
resumed run follows its own config's schedule (e.g. a longer `trainer.max_steps`), not the checkpoint's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from parallama.errors import ConfigError

AUTO_WARMUP_STEPS, AUTO_WARMUP_FRACTION = 60, 0.2


def resolve_warmup(warmup_steps: int | str, total_steps: int) -> int:
    """`auto`: 60 steps, or a fifth of a shorter run, so smoke tests (max_steps=5, fast_dev_run) need no
    extra override. An explicit number must leave room for the decay: it is never silently shortened."""
    if warmup_steps == "auto":
        return min(AUTO_WARMUP_STEPS, int(total_steps * AUTO_WARMUP_FRACTION))
    if warmup_steps >= total_steps:
        raise ConfigError(
            f"scheduler.warmup_steps={warmup_steps} is not below the run's {total_steps} optimizer steps; "
            "lower it, use scheduler.warmup_steps=auto, or train longer (trainer.max_steps)"
        )
    return warmup_steps


def warmup(step: int, warmup_steps: int, start_factor: float) -> float:
    """Linear from start_factor to 1 over warmup_steps."""
    return start_factor + (1.0 - start_factor) * step / warmup_steps


def warmup_cosine(
    step: int, *, warmup_steps: int, total_steps: int, start_factor: float, min_ratio: float
) -> float:
    """LR multiplier: linear from start_factor to 1 over warmup_steps, then cosine down to min_ratio at total_steps."""
    if step < warmup_steps:
        return warmup(step, warmup_steps, start_factor)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_stable_decay(
    step: int, *, warmup_steps: int, decay_steps: int, total_steps: int, start_factor: float, min_ratio: float
) -> float:
    """LR multiplier: linear warmup, then 1 until the last decay_steps, then linearly down to min_ratio."""
    if step < warmup_steps:
        return warmup(step, warmup_steps, start_factor)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, decay_steps))
    return 1.0 + (min_ratio - 1.0) * progress


def _check_fraction(key: str, value, *, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and 0 <= value and (value < 1 if high_open else value <= 1)):
        bounds = "[0, 1)" if high_open else "[0, 1]"
        raise ConfigError(f"scheduler.{key}={value!r} is not valid; use a number in {bounds}")


def _check_warmup(value) -> None:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"scheduler.warmup_steps={value!r} must be an integer >= 0 or auto")


@dataclass
class WarmupCosine:
    """Linear warmup from warmup_start_factor x lr over warmup_steps (auto: 60, or a fifth of a shorter run), then
    cosine decay to min_lr_ratio x lr at the run's last step. The default."""

    warmup_steps: int | str = "auto"
    warmup_start_factor: float = 0.1
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _check_warmup(self.warmup_steps)
        _check_fraction("warmup_start_factor", self.warmup_start_factor)
        _check_fraction("min_lr_ratio", self.min_lr_ratio)

    def lr_lambda(self, total_steps: int) -> Callable[[int], float]:
        return partial(
            warmup_cosine,
            warmup_steps=resolve_warmup(self.warmup_steps, total_steps),
            total_steps=total_steps,
            start_factor=self.warmup_start_factor,
            min_ratio=self.min_lr_ratio,
        )


@dataclass
class WarmupStableDecay(WarmupCosine):
    """Warmup-stable-decay (MiniCPM, DeepSeek): warmup, the peak LR held, then a linear decay to min_lr_ratio x lr
    over the last decay_fraction of the run. A run stopped before its decay leaves a checkpoint that a later,
    longer run can decay from."""

    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fraction("decay_fraction", self.decay_fraction)

    def lr_lambda(self, total_steps: int) -> Callable[[int], float]:
        warmup_steps = resolve_warmup(self.warmup_steps, total_steps)
        decay_steps = min(round(total_steps * self.decay_fraction), total_steps - warmup_steps)
        return partial(
            warmup_stable_decay,
            warmup_steps=warmup_steps,
            decay_steps=decay_steps,
            total_steps=total_steps,
            start_factor=self.warmup_start_factor,
            min_ratio=self.min_lr_ratio,
        )


@dataclass
class Constant:
    """The peak LR at every step, after an optional linear warmup (warmup_steps=0: none)."""

    warmup_steps: int | str = 0
    warmup_start_factor: float = 0.1

    def __post_init__(self) -> None:
        _check_warmup(self.warmup_steps)
        _check_fraction("warmup_start_factor", self.warmup_start_factor)

    def lr_lambda(self, total_steps: int) -> Callable[[int], float]:
        steps = resolve_warmup(self.warmup_steps, total_steps)
        return partial(
            warmup_cosine,
            warmup_steps=steps,
            total_steps=steps,
            start_factor=self.warmup_start_factor,
            min_ratio=1.0,
        )
