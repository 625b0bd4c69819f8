"""The key=value command lines of the checkpoint tools (parallama-export, parallama-generate, parallama-ckpt):
`--help` from the module docstring and defaults, unknown keys with a "did you mean", and bad input as one
`error:` line with exit code 2.

Separate from `checkpoint`: these tools take a few flat keys, not a Hydra config (parallama-train, -prepare
and -eval compose theirs with Hydra, see `compose`), and nothing here reads a checkpoint.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from parallama.errors import ConfigError


def usage(doc: str, defaults: dict) -> str:
    """--help text: the tool's module docstring and its keys with their defaults."""
    keys = "\n".join(f"  {key}={'null' if value is None else repr(value)}" for key, value in defaults.items())
    return f"{doc.strip()}\n\nKeys (defaults):\n{keys}"


def parse_cli(defaults: dict, argv: list[str] | None, required: tuple[str, ...] = ()) -> DictConfig:
    """`key=value` args over `defaults`; unknown keys and missing required ones are ConfigErrors."""
    from parallama.config.compose import _did_you_mean

    args = sys.argv[1:] if argv is None else argv
    valid = f"valid keys: {', '.join(defaults)}"
    if bad := [a for a in args if "=" not in a]:
        raise ConfigError(f"argument {bad[0]!r} is not key=value; {valid}")
    cfg = OmegaConf.create(defaults)
    for arg in args:
        if (key := arg.split("=", 1)[0]) not in defaults:
            raise ConfigError(f"unknown or invalid key {key!r}{_did_you_mean(key, cfg)}; {valid}")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(args))
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid argument ({str(err).splitlines()[0]}); {valid}") from None
    if missing := [k for k in required if cfg[k] is None]:
        raise ConfigError(f"{missing[0]}= is required; {valid}")
    return cfg


def run_cli(fn, argv: list[str] | None, help_text: str) -> None:
    """Run a CLI body: -h/--help prints `help_text`; bad input prints `error: <message>` and exits 2."""
    args = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(args):
        print(help_text)
        sys.exit(0)
    try:
        fn(args)
    except (ValueError, FileNotFoundError) as err:  # ConfigError and the model's own checks
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
