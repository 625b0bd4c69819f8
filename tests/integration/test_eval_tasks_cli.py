"""`parallama-eval tasks=[...]` on the shared tiny run's checkpoint and on its export: the same scores; and the
in-loop callback leaves training as it was."""

import csv
import json

from conftest import SHARED_RUN, run_cli, train

TASKS = ["tasks=[parallama_cloze,parallama_choice]", "limit=12", "json=true"]


def scores(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tasks_on_a_checkpoint_and_on_its_export(tiny_run, tmp_path, data_cache):
    ckpt = tiny_run.dir / "checkpoints" / "last.ckpt"
    args = [*TASKS, f"paths.cache_dir={data_cache}"]
    out = tmp_path / "scores.json"
    table = scores(run_cli("parallama.cli.evaluate", f"ckpt_path={ckpt}", *args, f"out={out}", cwd=tmp_path))
    assert set(table) == {"parallama_cloze", "parallama_choice"}
    assert set(table["parallama_choice"]) == {"acc", "acc_norm"}
    assert all(0 <= table[t]["acc"] <= 1 for t in table) and table["parallama_cloze"]["perplexity"] > 1
    assert json.loads(out.read_text()) == table

    run_cli("parallama.cli.export", f"ckpt_path={ckpt}", f"out_dir={tmp_path / 'hf'}", cwd=tmp_path)
    exported = run_cli("parallama.cli.evaluate", f"model_dir={tmp_path / 'hf'}", *args, cwd=tmp_path)
    assert scores(exported) == table


def test_a_bad_task_is_one_line_before_loading_anything(tmp_path, data_cache):
    proc = run_cli(
        "parallama.cli.evaluate",
        "ckpt_path=does/not/exist.ckpt",
        "tasks=[parallama_clozz]",
        f"paths.cache_dir={data_cache}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: tasks: parallama_clozz is not an lm-eval task (did you mean parallama_cloze?)"
    )


def losses(run) -> list[tuple[str, str, str]]:
    with open(run / "csv" / "metrics.csv") as f:
        rows = [(r["step"], r.get("train/loss", ""), r.get("val/loss", "")) for r in csv.DictReader(f)]
    return [row for row in rows if row[1] or row[2]]  # the callback's own rows carry neither


def test_the_callback_changes_nothing_in_training(tiny_run, tmp_path, data_cache):
    """Eval mode on and off again, no global RNG touched: the same losses, bit for bit, as the shared run."""
    every = ["callbacks.downstream_eval.every_n_steps=2", "callbacks.downstream_eval.limit=8"]
    proc = train(*SHARED_RUN, *every, cwd=tmp_path, cache=data_cache, run_dir=tmp_path / "run")
    assert "step 4: eval/parallama_choice/acc=" in proc.stdout + proc.stderr
    assert losses(tmp_path / "run") == losses(tiny_run.dir)
