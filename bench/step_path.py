"""The code a reader follows from `parallama-train` to the first `optimizer.step()`: every function of parallama's
own that runs on the way (traced with `sys.setprofile` in one tiny `strategy=auto` run), counted by file and by
the lines of those functions. What docs/architecture.md's "From a command line to a checkpoint" walks through."""

from __future__ import annotations

import inspect
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from bench.common import ROOT, machine, print_machine, save

SRC = ROOT / "src" / "parallama"
TINY = [
    "trainer.accelerator=cpu",
    "trainer.max_steps=1",
    "trainer.limit_val_batches=0",
    "validate_before_training=false",
    "sample.max_new_tokens=0",
    "data.batch_size=2",
    "data.seq_len=32",
    "data.source.max_documents=4",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
]


class StopAtTheStep(Exception):
    """Raised by the profiler when torch's optimizer begins its update: the path is complete."""


def trace(argv: list[str]) -> tuple[dict[str, set], dict[str, set]]:
    """{file under src/parallama: the lines of its functions that ran before the first optimizer step} (import-time
    code, module and class bodies, is not counted: a reader follows functions), from the command line and from the
    first `training_step` on (the step itself)."""
    seen: dict[str, set] = defaultdict(set)
    step: dict[str, set] = defaultdict(set)
    optim = str(Path(sys.modules["torch"].__file__).parent / "optim")

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        # Lightning runs training_step and backward in a closure inside optimizer.step(closure): the path ends
        # where the update begins, the optimizer's _init_group (torch's AdamW, Adam, SGD) after the closure
        if step and code.co_name == "_init_group" and code.co_filename.startswith(optim):
            sys.setprofile(None)
            raise StopAtTheStep
        if code.co_filename.startswith(str(SRC)) and code.co_flags & inspect.CO_OPTIMIZED:
            last = max((line for _, _, line in code.co_lines() if line), default=code.co_firstlineno)
            lines = range(code.co_firstlineno, last + 1)
            seen[code.co_filename].update(lines)
            if step or code.co_name == "training_step":
                step[code.co_filename].update(lines)

    from parallama.cli.train import main

    sys.setprofile(profile)
    try:
        main(argv)
    except (StopAtTheStep, SystemExit):
        pass
    finally:
        sys.setprofile(None)
    return seen, step


def add_arguments(p) -> None:
    p.add_argument("--strategy", default="auto")


def run(args) -> dict:
    import torch  # noqa: F401  (the profiler compares against torch's own files)

    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            *TINY,
            f"strategy={args.strategy}",
            f"paths.cache_dir={args.cache_dir}",
            f"hydra.run.dir={tmp}",
        ]
        paths = dict(zip(("command line", "training_step"), trace(argv)))
    info = machine()
    print_machine(info)
    result = {"strategy": args.strategy}
    for start, seen in paths.items():
        files = {str(Path(f).relative_to(SRC)): len(lines) for f, lines in seen.items()}
        result[start] = {"files": len(files), "lines": sum(files.values()), "by_file": files}
        print(
            f"from the {start} to optimizer.step() (strategy={args.strategy}): {len(files)} files, "
            f"{sum(files.values())} lines of the functions that ran"
        )
        for name, lines in sorted(files.items(), key=lambda kv: -kv[1]):
            print(f"  {lines:5d}  {name}")
    save(args.out, "step-path", info, result)
    return result
