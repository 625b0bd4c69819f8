"""`python -m bench <name> [options]`; `all` (also: no name, as `make bench` runs it) runs the CPU benchmarks
with their defaults."""

from __future__ import annotations

import argparse
import os
import sys

from bench import checksum, data, ddp_scaling, gpu, loss, nd, optim_step, overhead, step_path, train_gpu

BENCHMARKS = {
    "overhead": overhead,
    "data": data,
    "ddp-scaling": ddp_scaling,
    "nd": nd,
    "gpu": gpu,
    "step-path": step_path,
    "train-gpu": train_gpu,
    "loss": loss,
    "optim-step": optim_step,
    "checksum": checksum,
}
CPU_BENCHMARKS = ("overhead", "data", "ddp-scaling", "nd", "loss")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = p.add_subparsers(dest="name", required=True)
    for name, module in BENCHMARKS.items():
        s = sub.add_parser(name, help=module.__doc__.splitlines()[0])
        module.add_arguments(s)
        s.add_argument(
            "--cache-dir", default="data/cache", help="tokenized corpus cache (shared with training)"
        )
        s.add_argument("--out", help="write the results as JSON to this path, e.g. bench/results/<name>.json")
    a = sub.add_parser("all", help="the CPU benchmarks, each with its defaults")
    a.add_argument("--cache-dir", default="data/cache")
    a.add_argument("--out-dir", help="write <name>.json for each benchmark into this folder")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv or ["all"])
    if args.name != "all":
        BENCHMARKS[args.name].run(args)
        return
    for name in CPU_BENCHMARKS:
        out = os.path.join(args.out_dir, f"{name}.json") if args.out_dir else None
        print(f"\n=== {name}")
        main([name, "--cache-dir", args.cache_dir, *(["--out", out] if out else [])])


if __name__ == "__main__":
    main()
