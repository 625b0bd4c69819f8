"""Each part's own rules, asked of the class or function its `_target_` names, so a part of yours is checked as
the shipped one it stands for: a data source's or tokenizer's keys (`config_keys`), the strategy's keys and
refusals, the optimizer's, schedule's and loss's keywords (they build), a Trainer's arguments, and that every
`_target_` imports. What relates several keys, the machine and the files is in `checks`.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import inspect
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from parallama.config.parts import instantiate_part, locate, locate_target, targets
from parallama.errors import ConfigError
from parallama.rules import check_keys
from parallama.training.optim import check_optimizer

LIGHTNING_TRAINERS = ("lightning.pytorch.Trainer", "lightning.pytorch.trainer.Trainer", "lightning.Trainer")


@functools.lru_cache(maxsize=1)
def trainer_arguments() -> tuple[str, ...]:
    """The arguments of Lightning's `Trainer.__init__`, read from its source without importing Lightning
    (~8 s on a 2-core CPU: it imports torchmetrics, transformers, ...), so a typo'd `+trainer.key` answers at once."""
    spec = importlib.util.find_spec("lightning")
    if spec is None or spec.origin is None:
        return ()
    source = Path(spec.origin).parent / "pytorch" / "trainer" / "trainer.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "Trainer":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return tuple(a.arg for a in [*item.args.args, *item.args.kwonlyargs] if a.arg != "self")
    return ()


def check_trainer_keys(trainer: DictConfig, arguments: Sequence[str], name: str) -> None:
    """Each `trainer.<key>` is an argument of the Trainer class `name`: else its __init__ refuses it, but only
    after the data and model are built."""
    for key in trainer:
        key = str(key)
        if key.startswith("_") or key in arguments:
            continue
        close = difflib.get_close_matches(key, arguments, n=1)
        hint = f" (did you mean 'trainer.{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown config key 'trainer.{key}'{hint}: {name} has no argument {key!r}")


def check_your_trainer(trainer: DictConfig) -> None:
    """A Trainer of the user's own (`trainer._target_`, imported): its keys are the arguments of its `__init__`,
    and Lightning Trainer's where a subclass of it passes `**kwargs` on (another `**kwargs` takes anything)."""
    target = trainer.get("_target_")
    if not isinstance(target, str) or target in LIGHTNING_TRAINERS:
        return
    from lightning.pytorch import Trainer  # torch-free module

    found = locate_target(target, "trainer._target_")
    parameters = inspect.signature(found).parameters.values()
    arguments = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        if not (isinstance(found, type) and issubclass(found, Trainer)):
            return
        arguments += list(inspect.signature(Trainer).parameters)
    check_trainer_keys(trainer, arguments, target)


def part_nodes(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """(key, node) of the parts that state their own keys and inputs (`check_parts`, `check_inputs`): the
    tokenizer, the data source, each source of a mixture (data.sources.<name>.source)."""
    nodes = [("tokenizer", cfg.get("tokenizer")), ("data.source", OmegaConf.select(cfg, "data.source"))]
    if isinstance(sources := OmegaConf.select(cfg, "data.sources"), DictConfig):
        for name, entry in sources.items():
            if isinstance(entry, DictConfig):
                nodes.append((f"data.sources.{name}.source", entry.get("source")))
    return [(key, node) for key, node in nodes if isinstance(node, DictConfig) and "_target_" in node]


def part(node: DictConfig):
    """The class or function a part's `_target_` names; None if it does not import (`check_targets` and the
    part's build say why)."""
    try:
        return locate(node["_target_"])
    except Exception:  # ImportError, AttributeError, or what the module raised when imported
        return None


def check_parts(cfg: DictConfig) -> None:
    """Each part's keys by the rules its class or function declares (`config_keys`, e.g. data/sources.py
    `EmbeddedKeys`), asked of what its `_target_` names: a source or tokenizer of yours is checked as a shipped
    one. Also parallama-prepare's check."""
    for path, node in part_nodes(cfg):
        if (keys := getattr(part(node), "config_keys", None)) is not None:
            check_keys(cfg, keys, path)


def check_recipe(cfg: DictConfig) -> None:
    """The optimizer, schedule and loss build, each checking its own keys (training/optim.py, schedules.py,
    loss.py), and the strategy says what it cannot run with them; the cross-key rules here."""
    from parallama.training.schedules import check_torch_scheduler, names_torch_scheduler  # torch-free module

    optimizer = OmegaConf.to_container(cfg.optimizer, resolve=True)
    factory = check_optimizer(optimizer)
    _check_strategy_rules(cfg, factory.func)
    scheduler = OmegaConf.to_container(cfg.scheduler, resolve=True)
    max_steps = cfg.trainer.get("max_steps", -1)
    if names_torch_scheduler(scheduler):
        check_torch_scheduler(scheduler, max_steps)
    else:
        warmup = getattr(instantiate_part(scheduler, "scheduler"), "warmup_steps", "auto")
        if warmup != "auto" and max_steps is not None and max_steps > 0 and warmup >= max_steps:
            raise ConfigError(
                f"scheduler.warmup_steps={warmup} is not below trainer.max_steps={max_steps}; "
                "lower it, use scheduler.warmup_steps=auto, or train longer"
            )
    instantiate_part(OmegaConf.to_container(cfg.loss, resolve=True), "loss")
    if (target := OmegaConf.select(cfg, "module._target_")) != DEFAULT_MODULE:
        _check_module(target)


def _check_strategy_rules(cfg: DictConfig, optimizer: type) -> None:
    """The strategy's keys and refusals, asked of the class `strategy._target_` names (parallel/strategies/:
    `config_keys`, `refusal`), so that a subclass of yours is checked as the one it extends."""
    from parallama.parallel.base import strategy_class  # torch-free module

    strategy = strategy_class(cfg.strategy)
    if strategy is None:
        return
    if strategy.config_keys is not None:
        check_keys(cfg, strategy.config_keys, "strategy")
    if (line := strategy.refusal(cfg, optimizer)) is not None:
        raise ConfigError(line)


def check_targets(cfg: DictConfig) -> None:
    """Every other `_target_` the job builds (a strategy, callback, logger or data source of yours) imports, or
    one line naming its key, before the job prints its config (the recipe's parts are built in `check_recipe`)."""

    for path, target in targets(OmegaConf.to_container(cfg, resolve=False)):
        if not target.startswith("${"):
            locate_target(target, f"{path}._target_")


DEFAULT_MODULE = "parallama.training.module.CausalLM"


def _check_module(target) -> None:
    """`module._target_` names a LightningModule built like CausalLM (a subclass of it)."""
    from parallama.training.module import CausalLM  # torch-free module

    cls = locate_target(target, "module._target_")
    if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
        raise ConfigError(f"module._target_={target} is not a subclass of parallama.training.module.CausalLM")
