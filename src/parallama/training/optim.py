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
