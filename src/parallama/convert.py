"""`parallama-ckpt convert src=<checkpoint> out=<path> [format=file|dcp]`: any strategy's training checkpoint,
written at any world size (a Lightning file, a DeepSpeed folder, a DCP folder), as one file or as a DCP folder,
offline on CPU, with weights, AdamW moments, LR schedule, counters, data position and W&B run id.

Training resumes from any of these formats under any strategy anyway (docs/strategies.md, "Changing strategy
or GPU count mid-run"); converting makes a portable copy: one file for a small model, or a DCP folder that
reshards for FSDP. DeepSpeed's own format is written only by DeepSpeed at its world size: resume there with
strategy=deepspeed from either."""

from __future__ import annotations

import sys
from pathlib import Path

from parallama.cli import parse_cli, run_cli, usage
from parallama.errors import ConfigError
from parallama.parallel import universal
from parallama.untrusted import verify_checkpoint

DEFAULTS = {"src": None, "out": None, "format": "file"}


def convert(argv: list[str]) -> None:
    cfg = parse_cli(DEFAULTS, argv[1:] if argv[:1] == ["convert"] else argv, required=("src", "out"))
    if cfg.format not in ("file", "dcp"):
        raise ConfigError(f"format={cfg.format} is not one of file, dcp")
    if Path(cfg.out).exists():
        raise ConfigError(f"out={cfg.out} exists; give a new path")
    verify_checkpoint(cfg.src)
    state = universal.read(cfg.src)
    universal.write(state, cfg.out, cfg.format)
    print(f"converted {cfg.src} (step {state.client.get('global_step', '?')}) to {cfg.out} ({cfg.format})")


def main(argv: list[str] | None = None) -> None:
    run_cli(convert, sys.argv[1:] if argv is None else argv, usage(__doc__, DEFAULTS))


if __name__ == "__main__":
    main()
