"""The in-loop downstream evaluation under ddp: 2 ranks split the examples (21: one rank scores 11, the other 10),
both finish, the scores reach the CSV log at steps 0, 2 and 4, and they equal lm-eval's own `hf` model on the
exported last checkpoint (the same weights as the step-4 evaluation)."""

import csv

import pytest
from conftest import run_cli, train

from parallama.evaluation.tasks import EMBEDDED

pytestmark = pytest.mark.multiprocess
LIMIT = 21


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("downstream_ddp")
    every = ["callbacks.downstream_eval.every_n_steps=2", f"callbacks.downstream_eval.limit={LIMIT}"]
    proc = train("strategy=ddp", "trainer.devices=2", *every, cwd=tmp, cache=data_cache, run_dir=tmp / "run")
    return tmp / "run", proc.stdout + proc.stderr


def logged(run) -> dict[int, dict[str, float]]:
    with open(run / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("eval/parallama_choice/acc")]
    return {int(r["step"]): {k: float(v) for k, v in r.items() if k.startswith("eval/") and v} for r in rows}


def test_both_ranks_finish_and_the_scores_are_logged(ddp_run):
    run, out = ddp_run
    assert "rank 0/2" in out and "rank 1/2" in out and "Traceback" not in out
    assert "\nsample:\n" in out  # rank 0 got past the last evaluation and the end of training
    scores = logged(run)
    assert sorted(scores) == [0, 2, 4]
    keys = {"eval/parallama_cloze/acc", "eval/parallama_cloze/perplexity"}
    keys |= {"eval/parallama_choice/acc", "eval/parallama_choice/acc_norm"}
    assert all(set(s) == keys for s in scores.values())
    assert scores[0] != scores[4]  # the scores follow training


def test_in_loop_scores_equal_lm_evals_hf_model_on_the_export(ddp_run, tmp_path, data_cache):
    from lm_eval.evaluator import simple_evaluate

    from parallama.evaluation.harness import scores, task_manager

    run, _ = ddp_run
    hf = tmp_path / "hf"
    run_cli(
        "parallama.cli.export",
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        f"out_dir={hf}",
        cwd=tmp_path,
    )
    results = simple_evaluate(
        model="hf",
        model_args={"pretrained": str(hf), "dtype": "float32", "add_bos_token": True},
        tasks=list(EMBEDDED),
        task_manager=task_manager(list(EMBEDDED), str(data_cache)),
        limit=LIMIT,
        device="cpu",
        batch_size=8,
        bootstrap_iters=0,
    )
    theirs = {f"eval/{t}/{m}": v for t, ms in scores(results).items() for m, v in ms.items()}
    ours = logged(run)[4]
    assert set(ours) == set(theirs)
    for key, value in theirs.items():  # accuracies exactly; the perplexity to float32 summation order
        assert ours[key] == (value if "acc" in key else pytest.approx(value, rel=1e-5)), key
