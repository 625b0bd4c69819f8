"""Learning-rate schedules (conf/scheduler/): each a dataclass of its keys, checked when built, whose
`lr_lambda(total_steps)` gives the multiplier of the peak LR (`optimizer.lr`) at each optimizer step, for torch's
`LambdaLR`. A schedule of your own is a class with that method, named by `scheduler._target_` (docs/customize.md).

The multiplier is a `functools.partial` of a plain function: LambdaLR's checkpoint then stores nothing of it, so a
resumed run follows its own config's schedule (e.g. a longer `trainer.max_steps`), not the checkpoint's.

`scheduler._target_` may also name one of torch's own schedulers (`torch.optim.lr_scheduler.OneCycleLR`,
conf/scheduler/one_cycle.yaml), or an `LRScheduler` subclass of yours: `torch_scheduler` builds it on the optimizer,
what the run knows filled in. It resumes as torch saved it.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from parallama.config.parts import instantiate_part, locate_target
from parallama.errors import ConfigError
from parallama.rules import show

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


# --- torch's own schedulers ----------------------------------------------------------------------------------

# A scheduler's length in optimizer steps: OneCycleLR's, CosineAnnealingLR's, LinearLR's (ConstantLR's...)
LENGTH_KEYWORDS = ("total_steps", "T_max", "total_iters")


def names_torch_scheduler(config: Mapping) -> bool:
    """Whether `scheduler._target_` names a torch `LRScheduler` (torch's or yours) rather than a schedule with
    `lr_lambda`."""
    target = config.get("_target_")
    cls = locate_target(target, "scheduler._target_") if isinstance(target, str) else None
    return isinstance(cls, type) and issubclass(cls, LRScheduler)


def torch_scheduler(config: Mapping, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """The scheduler `config` names, called with `optimizer` and its keywords, for a run of `total_steps` optimizer
    steps. What it leaves out the run fills in: its length (`LENGTH_KEYWORDS`, unless OneCycleLR's `epochs` sets
    it) is the run's steps, a `max_lr` each group's configured LR (`optimizer.lr` stays the peak). A keyword the class
    does not take, or a value the class refuses, is one line naming the key."""
    factory = instantiate_part(config, "scheduler", _partial_=True)
    cls, keywords = factory.func, dict(factory.keywords)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if issubclass(cls, ReduceLROnPlateau):
        raise ConfigError(
            f"scheduler._target_={name} steps on a metric, not on optimizer steps; use a schedule of steps "
            "(conf/scheduler/)"
        )
    parameters = inspect.signature(cls).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if unknown := [] if takes_any else [f"scheduler.{key}" for key in keywords if key not in parameters]:
        others = f" (nor {', '.join(unknown[1:])})" if unknown[1:] else ""
        raise ConfigError(  # the keys of the schedule it replaced, as often as not: start from none
            f"{unknown[0]} is not a keyword of {name}{others}; drop it, or give the class its own keys alone: "
            f"'~scheduler' +scheduler._target_={name} +scheduler.<keyword>=... "
            "(or a yaml: conf/scheduler/one_cycle.yaml)"
        )
    length = next((key for key in LENGTH_KEYWORDS if key in parameters), None)
    if length and not keywords.keys() & {*LENGTH_KEYWORDS, "epochs"}:
        keywords[length] = total_steps
    if "max_lr" in parameters and "max_lr" not in keywords:
        keywords["max_lr"] = [group["lr"] for group in optimizer.param_groups]
    try:
        return cls(optimizer, **keywords)
    except (TypeError, ValueError) as err:  # a value the class refuses, in its own words
        reason = " ".join(str(err).split())
        named = [key for key in keywords if re.search(rf"\b{re.escape(key)}\b", reason)]
        if len(named) == 1:
            raise ConfigError(f"scheduler.{named[0]}={show(keywords[named[0]])}: {reason}") from None
        raise ConfigError(f"scheduler._target_={name}: {reason}") from None


def check_torch_scheduler(config: Mapping, max_steps: int | None) -> None:
    """Before any work: `torch_scheduler` on a stand-in optimizer, with one parameter group or as many as a list
    of the config has values (`max_lr: [...]`, one per group), for a run of `max_steps` (1 where the run counts
    epochs: its steps are known once the data is); then a `total_steps` shorter than the run, at whose end
    OneCycleLR would stop it."""
    steps = max_steps if max_steps and max_steps > 0 else 1
    groups = max((len(value) for value in config.values() if isinstance(value, list)), default=1)
    stand_in = torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=1.0, momentum=0.9
    )
    torch_scheduler(config, stand_in, steps)
    given = config.get("total_steps")
    if isinstance(given, int) and not isinstance(given, bool) and given < steps:
        raise ConfigError(
            f"scheduler.total_steps={given} is below trainer.max_steps={max_steps}; leave it out to schedule over "
            "the run"
        )


# --- the run's scheduler (CausalLM.configure_optimizers) -------------------------------------------------------


def lr_scheduler(config: Mapping, optimizer, total_steps: int, *, fast_dev_run: bool = False) -> LRScheduler:
    """The scheduler of `config` on `optimizer`, for a run of `total_steps` optimizer steps: torch's own
    (`torch_scheduler`), or a `LambdaLR` of the schedule's multiplier. fast_dev_run is a smoke test of a config (e.g.
    an experiment preset with 1000 warmup steps): its one or few steps say nothing about the schedule, so they take
    `auto` instead of refusing the preset's warmup."""
    if names_torch_scheduler(config):
        return torch_scheduler(config, optimizer, total_steps)
    schedule = instantiate_part(config, "scheduler")
    if fast_dev_run and hasattr(schedule, "warmup_steps"):
        schedule = replace(schedule, warmup_steps="auto")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_lambda(total_steps))


def apply_configured_lrs(scheduler: LRScheduler, lrs: list[float]) -> float | None:
    """A resumed scheduler brings back the checkpoint's peak LRs; the optimizer's config is what this run asks for
    (`lrs`: each group's LR as built: one `optimizer.lr`, or Muon's and AdamW's). Sets them, at the resumed step's
    multiplier, and returns the checkpoint's first one; None where they were the same already, and for a torch
    scheduler of the config (OneCycleLR...), which goes on as torch saved it."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) or list(scheduler.base_lrs) == lrs:
        return None
    saved = scheduler.base_lrs[0]
    scheduler.base_lrs = list(lrs)
    for group, lr, factor in zip(scheduler.optimizer.param_groups, lrs, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = lr, lr * factor(scheduler.last_epoch)
    return saved
