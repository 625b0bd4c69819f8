"""What one key accepts (`Rule`: a kind, a range, choices; `Check`: any test, described) and the one line that
says a value is not that. The training config's keys and their rules are in `schema`; the tools (parallama-
prepare, -generate, -eval, -plan, -ckpt) state their few keys' rules with these too."""

from __future__ import annotations

from collections.abc import Callable
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


def check_values(cfg: DictConfig, rules: dict[str, Rule]) -> None:
    """Each key of `rules` (dotted) that the config has against its rule, in one line naming the first bad one."""
    for dotted, rule in rules.items():
        parent, _, leaf = dotted.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig) and leaf in node:
            check_value(dotted, node[leaf], rule)


def check_value(dotted: str, value, rule: Rule) -> None:
    if not rule.valid(value):
        raise ConfigError(f"{dotted}={show(value)} is not valid; use {rule.describe()}")
