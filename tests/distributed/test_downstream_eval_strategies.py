"""The in-loop downstream evaluation on 2 ranks under each strategy family: ddp replicates the model, FSDP2
(`strategy=fsdp`) and DeepSpeed ZeRO-3 (`strategy=deepspeed strategy.stage=3`) shard its parameters, so every
forward pass of the evaluation gathers them collectively and the ranks must run them in lockstep.

ddp: the ranks split the examples (21: one rank scores 11, the other 10), both finish, the scores reach the CSV
log at steps 0, 2 and 4, and they equal lm-eval's own `hf` model on the exported last checkpoint (the same
weights as the step-4 evaluation). FSDP2 and ZeRO-3: the same run finishes on both ranks within a deadline (a
hang would not) and logs the ddp run's scores at the same steps. Same seed, same data: the strategies' weights
agree to ~1e-6 (test_strategies.py), so the accuracies must be equal and the perplexities equal to rounding.
The first DeepSpeed run in a fresh environment JIT-builds DeepSpeed's C++ ops (~1 min on 2 idle cores, 3.5 min
measured on a loaded one; once per environment: conftest's private TORCH_EXTENSIONS_DIR, shared with the other
DeepSpeed tests), so the ZeRO-3 case can take that much longer.
"""

import csv

import pytest
from conftest import run_cli, train

from parallama.evaluation.tasks import EMBEDDED

pytestmark = pytest.mark.multiprocess
LIMIT = 21
EVERY = ["callbacks.downstream_eval.every_n_steps=2", f"callbacks.downstream_eval.limit={LIMIT}"]
SHARDED = {"fsdp": ["strategy=fsdp"], "deepspeed_zero3": ["strategy=deepspeed", "strategy.stage=3"]}
# A run takes ~45 s on this 2-core machine; a hang ends at the deadline instead of never. ZeRO-3's allows for
# DeepSpeed's op build when this is the environment's first DeepSpeed run (measured 3.5 min on a loaded machine).
DEADLINE = {"ddp": 300, "fsdp": 300, "deepspeed_zero3": 600}
# The perplexity is exp(mean NLL), so its relative difference is the absolute difference of the mean NLL (~41
# nats here): float32 log-probabilities alone carry ~41 x 6e-8 = 2.5e-6 of it. Measured against ddp: 0 at step 0
# (the same weights), <= 4.6e-7 at steps 2 and 4. An example scored twice or missed moves it by orders more.
PPL_REL = 1e-5


def run_on_two_ranks(tmp, cache, name: str, *strategy: str) -> tuple:
    every = (*strategy, "trainer.devices=2", *EVERY)
    proc = train(*every, cwd=tmp, cache=cache, run_dir=tmp / "run", timeout=DEADLINE[name])
    return tmp / "run", proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, data_cache):
    return run_on_two_ranks(tmp_path_factory.mktemp("downstream_ddp"), data_cache, "ddp", "strategy=ddp")


def logged(run) -> dict[int, dict[str, float]]:
    with open(run / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("eval/parallama_choice/acc")]
    return {int(r["step"]): {k: float(v) for k, v in r.items() if k.startswith("eval/") and v} for r in rows}


def assert_every_rank_finished(out: str) -> None:
    """Both ranks started, nothing failed, and rank 0 printed the end-of-run sample, which comes after the last
    evaluation (under FSDP/ZeRO-3 generating it is collective too: rank 1 took part to the end). The run's
    process returned (exit status 0) and its output pipe closed, which rank 1 holds until it exits."""
    assert "rank 0/2" in out and "rank 1/2" in out and "Traceback" not in out
    assert "\nsample:\n" in out


def test_both_ranks_finish_and_the_scores_are_logged(ddp_run):
    run, out = ddp_run
    assert_every_rank_finished(out)
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


@pytest.mark.parametrize("strategy", SHARDED)
def test_sharded_strategies_log_the_ddp_runs_scores(strategy, ddp_run, tmp_path, data_cache):
    run, out = run_on_two_ranks(tmp_path, data_cache, strategy, *SHARDED[strategy])
    assert_every_rank_finished(out)
    ours, reference = logged(run), logged(ddp_run[0])
    assert sorted(ours) == sorted(reference) == [0, 2, 4]
    for step in reference:
        assert set(ours[step]) == set(reference[step]), step
        for key, value in reference[step].items():  # accuracies exactly; perplexity: see PPL_REL
            expected = value if "acc" in key else pytest.approx(value, rel=PPL_REL)
            assert ours[step][key] == expected, (step, key)
