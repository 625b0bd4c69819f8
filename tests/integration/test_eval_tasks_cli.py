"""`parallama-eval tasks=[...]` on the shared tiny run's checkpoint and on its export: the same scores."""

import json

from conftest import run_cli

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
