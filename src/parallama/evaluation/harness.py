"""lm-evaluation-harness tasks run on a parallama model (`lm.ParallamaLM`): the task index (the embedded tasks,
local task folders, lm-eval's own), the scores as {task: {metric: value}} on every rank, and lm-eval's output
kept out of a training log. Used by `parallama-eval` and `callbacks.downstream_eval`.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import re
import sys

import torch.distributed as dist

from parallama.errors import ConfigError
from parallama.evaluation.lm import ParallamaLM
from parallama.evaluation.tasks import build


def task_manager(tasks: list[str], cache_dir: str, task_dirs=()):
    """lm-eval's TaskManager over the embedded tasks (built under `cache_dir`) and `task_dirs`, and lm-eval's
    own tasks when `tasks` names one of those; a task it does not know is a ConfigError."""
    from lm_eval.tasks import TaskManager  # start-up time (datasets)

    include = [str(build(cache_dir)), *map(str, task_dirs)]
    manager = ours = TaskManager(include_path=include, include_defaults=False)
    for task in tasks:  # a near miss of one of ours is a typo: say so before indexing lm-eval's thousands
        if task not in ours.all_tasks and (close := difflib.get_close_matches(task, ours.all_tasks, n=1)):
            raise ConfigError(f"tasks: {task} is not an lm-eval task (did you mean {close[0]}?)")
    if not set(tasks) <= set(ours.all_tasks):  # lm-eval's own tasks: index them too (several seconds)
        manager = TaskManager(include_path=include)
    if unknown := [t for t in tasks if t not in manager.all_tasks]:
        raise ConfigError(
            f"tasks: {unknown[0]} is not an lm-eval task; ours: {', '.join(sorted(ours.all_subtasks))}, "
            "or any of lm-eval's (lm-eval ls tasks)"
        )
    return manager


def evaluate(
    lm: ParallamaLM, tasks: list[str], *, cache_dir: str, task_dirs=(), limit: int | float | None = None
) -> dict[str, dict[str, float]]:
    """Scores of `tasks`, {task: {metric: value}}, the same on every rank. lm-eval's `evaluate`, not
    `simple_evaluate`: that one reseeds the global RNGs (a training run's) and collects environment
    information at each call."""
    from lm_eval import evaluator  # start-up time (datasets)
    from lm_eval.tasks import get_task_dict  # start-up time (datasets)

    with without_progress_bars():
        task_dict = get_task_dict(list(tasks), task_manager(tasks, cache_dir, task_dirs))
        out = evaluator.evaluate(lm, task_dict, limit=limit, bootstrap_iters=0, log_samples=False)
    if getattr(lm, "dp_ranks", None) is not None:  # lm-eval gathers the results on rank 0 only
        box = [out]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
    return scores(out)


@contextlib.contextmanager
def without_progress_bars():
    """lm-eval's INFO lines and progress bars (its own, datasets') at every evaluation would fill a training log;
    anything else written to stderr meanwhile still gets there."""
    lm_eval_log, level = logging.getLogger("lm_eval"), logging.getLogger("lm_eval").level
    lm_eval_log.setLevel(logging.WARNING)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    finally:
        lm_eval_log.setLevel(level)
        kept = [
            line for line in captured.getvalue().splitlines() if line.strip() and not PROGRESS.search(line)
        ]
        if kept:
            print("\n".join(kept), file=sys.stderr)


PROGRESS = re.compile(r"\d+%\||it/s\]|s/it\]|examples/s\]")


def scores(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results ("acc,none" -> "acc"; stderr and aliases dropped)."""
    table = {}
    for task, metrics in results["results"].items():
        table[task] = {
            key.split(",")[0]: float(value)
            for key, value in metrics.items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float))
        }
    return table
