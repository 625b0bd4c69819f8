"""What one key accepts (`Rule`: a kind, a range, choices; `Check`: any test, described), a config key as a
dataclass field beside its default (`key`), and the one line that says a value is not valid. The training
config's keys are in `schema`; each other tool (parallama-prepare, -generate, -eval, -plan, -ckpt) declares its
own few keys in a dataclass of the same kind next to it, and so does each part a `_target_` names whose keys
differ by option (a strategy, a data source, a tokenizer: its `config_keys`).
Not OmegaConf structured configs: no range, choice or trainer.devices, 3-line refusals (test_library_gaps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from parallama.errors import ConfigError


def show(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


class Rule:
    """What one key accepts: a kind (int, float, bool, str) within [low, high] (`open` makes the bounds
    exclusive: "low", "high" or "both"), a fixed set of `choices`, and extra allowed values (null, -1, auto)."""

    def __init__(self, kind: type, low=None, high=None, *, open: str = "", allow=(), choices=()):
        self.kind, self.low, self.high, self.open, self.allow, self.choices = (
            kind,
            low,
            high,
            open,
            allow,
            choices,
        )

    def valid(self, value) -> bool:
        if any(value is a or (type(value) is type(a) and value == a) for a in self.allow):
            return True
        if isinstance(value, bool) != (self.kind is bool):
            return False
        if self.choices:
            return value in self.choices
        if not isinstance(value, (int, float) if self.kind is float else self.kind):
            return False
        if self.low is not None and (value <= self.low if "low" in self.open else value < self.low):
            return False
        return self.high is None or (value < self.high if "high" in self.open else value <= self.high)

    def describe(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(show(c) for c in self.choices)
        else:
            text = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[self.kind]
        if self.low is not None and self.high is not None:
            text += f" in {'(' if 'low' in self.open else '['}{self.low}, {self.high}{')' if 'high' in self.open else ']'}"
        elif self.low is not None:
            text += f" {'>' if 'low' in self.open else '>='} {self.low}"
        return text + "".join(f" or {show(a)}" for a in self.allow)


class Check(Rule):
    """A key whose valid values are not a kind and a range (a list, a duration): `valid(value)`, described."""

    def __init__(self, valid: Callable[[Any], bool], description: str):
        self.valid, self.description = valid, description  # type: ignore[method-assign]

    def describe(self) -> str:
        return self.description


def key(default, rule: Rule | None = None):
    """A field: its default (the conf file's value) and what it accepts (None: anything, e.g. a path, a name,
    what a library reads as it likes: Hydra hands `name=2026` over as an int)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


def rules(schema: type) -> dict[str, Rule]:
    """A class's keys and their rules (the keys that have one)."""
    return {f.name: f.metadata["rule"] for f in fields(schema) if f.metadata.get("rule") is not None}


def check_keys(cfg: DictConfig, schema: type, path: str = "") -> None:
    """The keys of `schema` (a dataclass of `key` fields) that the config node at `path` has, by their rules."""
    check_values(cfg, {f"{path}.{name}" if path else name: rule for name, rule in rules(schema).items()})


def check_values(cfg: DictConfig, by_key: dict[str, Rule]) -> None:
    """Each key of `by_key` (dotted) that the config has against its rule, in one line naming the first bad one."""
    for dotted, rule in by_key.items():
        parent, _, leaf = dotted.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig) and leaf in node:
            check_value(dotted, node[leaf], rule)


def check_value(dotted: str, value, rule: Rule) -> None:
    if not rule.valid(value):
        raise ConfigError(f"{dotted}={show(value)} is not valid; use {rule.describe()}")
