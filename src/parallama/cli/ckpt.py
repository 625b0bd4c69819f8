"""`parallama-ckpt convert src=<checkpoint> out=<path> [format=file|dcp|deepspeed]`: any strategy's training
checkpoint in another format (app/convert.py). A Hydra app (conf/ckpt.yaml)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import DictConfig, OmegaConf

from parallama import CONF_DIR
from parallama.cli import app
from parallama.errors import ConfigError
from parallama.rules import Rule, check_keys, key, show

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")  # as the Trainer names them
DEEPSPEED_ONLY = ("devices", "stage", "offload", "precision")


@dataclass
class Convert:
    """The tool's keys, their defaults and the valid values of those that hold for every format (rules.py
    `key`); what only format=deepspeed takes is checked below."""

    conf: ClassVar[str] = "ckpt.yaml"

    src: str = key("???")
    out: str = key("???")
    format: str = key("file", Rule(str, choices=("file", "dcp", "deepspeed")))
    devices: int = key(1)
    stage: int = key(2)
    offload: bool = key(False, Rule(bool))
    precision: str = key("32-true")


def check(cfg: DictConfig, hardware: bool = True) -> None:
    check_keys(cfg, Convert)
    if cfg.format != "deepspeed":
        defaults = OmegaConf.load(CONF_DIR / "ckpt.yaml")
        if given := [key for key in DEEPSPEED_ONLY if cfg[key] != defaults[key]]:
            raise ConfigError(f"{given[0]}= applies to format=deepspeed only (format={cfg.format})")
        return
    if cfg.stage not in (1, 2, 3):
        raise ConfigError(f"stage={show(cfg.stage)} is not a ZeRO stage (1, 2 or 3)")
    if not (isinstance(cfg.devices, int) and not isinstance(cfg.devices, bool) and cfg.devices > 0):
        raise ConfigError(
            f"devices={show(cfg.devices)}: give the resuming run's number of GPUs (an integer > 0)"
        )
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"precision={cfg.precision} is not one of {', '.join(PRECISIONS)}")


def convert(cfg: DictConfig) -> None:
    from parallama.app.convert import convert  # torch-free module

    convert(cfg)


def main(argv: list[str] | None = None) -> None:
    app.run("ckpt", convert, argv, check=check, subcommand="convert", list_keys=True)


if __name__ == "__main__":
    main()
