"""How much of parallama a reader follows from `parallama-train` to the first `optimizer.step()`, traced with
`sys.setprofile` in one tiny `strategy=auto` run and counted by file, by the lines of the functions that ran and
by the whole files' lines. Four sets of functions, each the one before it and more:

- the step: every function from `training_step` on (the loss, the model's forward, backward, clipping: Lightning
  runs them in a closure inside `optimizer.step`);
- the path: the step and the functions on the call stack when the update begins (the command line, the job,
  `trainer.fit` to the module's `optimizer_step`). Issue #27's aim is counted on it, as its figures for
  lightning-hydra-template were: its "4 files, ~520 lines" are train.py, utils/utils.py (`task_wrapper`),
  models/mnist_module.py and models/components/simple_dense_net.py (522 lines), not its data module or the
  utils that ran and returned before the step;
- the first batch: the path and all that runs in the training loop's first iteration before the update (the
  batch's data, the callbacks' batch hooks);
- the command line: everything that ran before the update (the config check, the data cache, the model's
  build, the callbacks' setup too).

What docs/architecture.md's "From a command line to a checkpoint" walks through."""

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
PATHS = ("training_step", "path", "first batch", "command line")
AIM = {"files": 12, "lines": 1500}  # issue #27, on the path


class StopAtTheStep(BaseException):
    """Raised by the profiler when torch's optimizer begins its update: the path is complete. Not an Exception,
    as SystemExit is not: Hydra and the CLI's error report let it through to `trace` without a traceback."""


def _lines(code) -> range:
    last = max((line for _, _, line in code.co_lines() if line), default=code.co_firstlineno)
    return range(code.co_firstlineno, last + 1)


def trace(argv: list[str]) -> dict[str, dict[str, set]]:
    """{one of PATHS: {file under src/parallama: the lines of its functions in that set}}. Import-time code
    (module and class bodies) is not counted: a reader follows functions."""
    found: dict[str, dict[str, set]] = {name: defaultdict(set) for name in PATHS}
    optim = str(Path(sys.modules["torch"].__file__).parent / "optim")
    started = {"loop": False, "step": False}

    def ours(code) -> bool:
        return code.co_filename.startswith(str(SRC)) and bool(code.co_flags & inspect.CO_OPTIMIZED)

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "advance" and code.co_filename.endswith("training_epoch_loop.py"):
            started["loop"] = True  # Lightning's first iteration: fetch a batch, its hooks, the step
        # Lightning runs training_step and backward in a closure inside optimizer.step(closure): the path ends
        # where the update begins, the optimizer's _init_group (torch's AdamW, Adam, SGD) after the closure
        if started["step"] and code.co_name == "_init_group" and code.co_filename.startswith(optim):
            sys.setprofile(None)
            caller = frame
            while caller is not None:
                if ours(caller.f_code):
                    for name in ("path", "first batch"):
                        found[name][caller.f_code.co_filename].update(_lines(caller.f_code))
                caller = caller.f_back
            raise StopAtTheStep
        if ours(code):
            started["step"] = started["step"] or code.co_name == "training_step"
            sets = ("command line",)
            sets += ("first batch",) if started["loop"] else ()
            sets += ("path", "training_step") if started["step"] else ()
            for name in sets:
                found[name][code.co_filename].update(_lines(code))

    from parallama.cli.train import main

    sys.setprofile(profile)
    try:
        main(argv)
    except (StopAtTheStep, SystemExit):
        pass
    finally:
        sys.setprofile(None)
    return found


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
        found = trace(argv)
    info = machine()
    print_machine(info)
    result = {"strategy": args.strategy, "aim": AIM}
    for name in PATHS:
        files = {str(Path(f).relative_to(SRC)): len(lines) for f, lines in found[name].items()}
        whole = sum(len((SRC / f).read_text().splitlines()) for f in files)
        result[name] = {
            "files": len(files),
            "lines": sum(files.values()),
            "file_lines": whole,
            "by_file": files,
        }
        print(
            f"{name} (strategy={args.strategy}): {len(files)} files, {sum(files.values())} lines of the functions "
            f"that ran ({whole} lines in those files)"
        )
        for file, lines in sorted(files.items(), key=lambda kv: -kv[1]):
            print(f"  {lines:5d}  {file}")
    path = result["path"]
    within = path["files"] <= AIM["files"] and path["lines"] <= AIM["lines"]
    print(
        f"the path, against issue #27's aim (<= {AIM['files']} files, <= {AIM['lines']} lines): "
        f"{path['files']} files, {path['lines']} lines: {'within' if within else 'over'}"
    )
    save(args.out, "step-path", info, result)
    return result
