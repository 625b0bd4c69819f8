"""The optimizer of the recipe (conf/optimizer/): whatever class `optimizer._target_` names, any `torch.optim`
optimizer or your own, built by Hydra as a partial and called with the module's parameter groups
(`CausalLM.param_groups`: weight decay on matrices, none on norms). The strategy only builds it; one that cannot
run the named class (DeepSpeed's optimizer offload: parallel/strategies/deepspeed.py) says so in one line.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from functools import partial

from parallama.config.parts import instantiate_part
from parallama.errors import ConfigError


def optimizer_factory(config: Mapping) -> partial:
    """`config` (conf/optimizer: `_target_` and the constructor's keywords) as `factory(param_groups)`."""
    factory = instantiate_part(config, "optimizer", _partial_=True)
    if "betas" in factory.keywords:  # a YAML list: torch's optimizers check for a tuple
        factory.keywords["betas"] = tuple(factory.keywords["betas"])
    if factory.keywords.get("fused", False) is None and not _takes(factory.func, "fused"):
        del factory.keywords[
            "fused"
        ]  # null is "parallama's choice": no fused kernel where the class has none
    return factory


def _takes(func, keyword: str) -> bool:
    return keyword in inspect.signature(func).parameters


def check_optimizer(config: Mapping) -> partial:
    """Before any work: the class exists and takes every configured keyword (one line naming the one it lacks)."""
    factory = optimizer_factory(config)
    try:
        inspect.signature(factory.func).bind(None, **factory.keywords)
    except TypeError as err:
        name = f"{factory.func.__module__}.{factory.func.__qualname__}"
        raise ConfigError(
            f"optimizer._target_={name} does not take the configured keywords ({err}); remove a key with "
            "'~optimizer.<key>' or choose another optimizer"
        ) from None
    if check := getattr(factory.func, "check_keywords", None):  # a class that checks its values (muon.py)
        check(factory.keywords)
    return factory


def with_fused_default(factory: partial, *, on_gpu: bool, loss_scaled: bool, clipping: bool) -> partial:
    """`fused: null` (conf/optimizer/adamw.yaml; muon.yaml's `adamw_fused`, the class's `fused_keyword`) is
    parallama's choice: torch's fused kernel on GPU, except under fp16's loss scaler, where a fused step unscales
    the gradients itself, after Lightning clipped them scaled."""
    key = getattr(factory.func, "fused_keyword", "fused")
    if key not in factory.keywords:
        return factory
    fused = factory.keywords[key]
    if fused is None:
        fused = on_gpu and not loss_scaled
    elif fused and loss_scaled and clipping:
        raise ConfigError(
            f"optimizer.{key}=true with trainer.precision=16-mixed and trainer.gradient_clip_val: a fused optimizer "
            f"unscales fp16 gradients inside its step, after clipping; set optimizer.{key}=null, "
            "trainer.precision=bf16-mixed or trainer.gradient_clip_val=null"
        )
    return partial(factory.func, *factory.args, **{**factory.keywords, key: fused or None})


def peak_lr(factory: Callable) -> float:
    """The LR the optimizer is built with: the configured one, else the class's default."""
    if "lr" in factory.keywords:
        return factory.keywords["lr"]
    default = inspect.signature(factory.func).parameters.get("lr")
    return default.default if default is not None else float("nan")


# --- optimizers with modes -----------------------------------------------------------------------------------


def has_modes(optimizer) -> bool:
    """Whether `optimizer` (an instance or its class) has a train and an eval mode, as schedule-free optimizers do:
    they train at one point and evaluate at another, and `train()`/`eval()` move the weights between the two."""
    return callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None))


def set_modes(optimizers, train: bool) -> None:
    """Each optimizer with modes in train (or eval) mode; a no-op for one already in it, and for the others."""
    for optimizer in optimizers:
        if has_modes(optimizer):
            optimizer.train() if train else optimizer.eval()


def modes_refusal(optimizer_class: type, optimizers) -> str | None:
    """Why a run cannot train `optimizer_class`, which has modes: the strategy wrapped it in an optimizer of its own
    that does not pass `train()`/`eval()` on (ZeroRedundancyOptimizer, DeepSpeed's ZeRO)."""
    if not has_modes(optimizer_class) or any(has_modes(o) for o in optimizers):
        return None
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    wrapper = type(optimizers[0]).__name__ if optimizers else "the strategy's optimizer"
    return (
        f"optimizer._target_={name} has train and eval modes, which {wrapper} does not pass on; use strategy=auto, "
        "ddp or fsdp"
    )


def stacked_warmup(optimizer, peak_lrs: list[float]) -> str | None:
    """The warning for a schedule that warms the learning rate up on top of the optimizer's own warmup (a
    schedule-free optimizer's `warmup_steps`): the first steps would take the product of both. Read once the
    scheduler has set the first step's LR, as a share of the configured one (`peak_lrs`, one per group)."""
    own = max((group.get("warmup_steps") or 0 for group in optimizer.param_groups), default=0)
    first = optimizer.param_groups[0]["lr"] / peak_lrs[0]
    if not own or first >= 1:
        return None
    return (
        f"optimizer.warmup_steps={own} warms the learning rate up itself, and the scheduler warms it up again on top "
        f"(its multiplier starts at {first:g}): use scheduler=constant, or optimizer.warmup_steps=0"
    )
