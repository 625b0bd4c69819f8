"""parallama-eval and parallama-generate on a tiny trained run (see test_export.trained_run)."""

import csv
import json
import math

import pytest
from conftest import run_cli
from test_export import trained_run

from parallama.cli.ckpt import main as convert_main
from parallama.cli.evaluate import main as eval_main
from parallama.cli.export import main as export_main
from parallama.cli.generate import generate_text
from parallama.cli.generate import main as generate_main
from parallama.cli.plan import main as plan_main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return trained_run(tmp_path_factory.getbasetemp()) / "checkpoints" / "last.ckpt"


def test_eval_reproduces_the_runs_val_loss(ckpt, tmp_path):
    """Same held-out documents, same tokenizer, same weights: the loss training logged last."""
    proc = run_cli("parallama.cli.evaluate", f"ckpt_path={ckpt}", "max_batches=2", "json=true", cwd=tmp_path)
    result = json.loads(proc.stdout)
    with open(ckpt.parent.parent / "csv" / "metrics.csv") as f:
        logged = [float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")]
    assert math.isfinite(result["loss"]) and result["tokens"] > 0
    assert result["loss"] == pytest.approx(logged[-1], rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(result["loss"]))


def test_eval_of_a_checkpoint_copied_on_its_own(ckpt, tmp_path):
    """No run config beside it (found: `ConfigAttributeError: Key 'name_or_path' is not in struct`): the eval
    config's data with the checkpoint's tokenizer, said in one line."""
    lone = tmp_path / "copied.ckpt"
    lone.write_bytes(ckpt.read_bytes())
    args = [f"ckpt_path={lone}", "max_batches=2", "json=true", "data.seq_len=64"]
    proc = run_cli("parallama.cli.evaluate", *args, cwd=tmp_path)
    assert f"no run config beside {lone}" in proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert math.isfinite(result["loss"]) and result["tokens"] > 0


def test_eval_train_split_and_text_output(ckpt, capsys):
    eval_main([f"ckpt_path={ckpt}", "split=train", "data.batch_size=1", "max_batches=1", "data.seq_len=16"])
    out = capsys.readouterr().out.strip()
    fields = dict(item.split("=") for item in out.split())
    assert set(fields) == {"loss", "ppl", "tokens"} and fields["tokens"] == "16", out


def test_greedy_generation_is_deterministic_and_the_same_from_an_export(ckpt, tmp_path):
    args = ["prompt=Once", "max_new_tokens=12", "temperature=0"]
    text = generate_text([f"ckpt_path={ckpt}", *args])
    assert text.startswith("Once") and len(text) > len("Once")
    assert generate_text([f"ckpt_path={ckpt}", *args]) == text
    export_main([f"ckpt_path={ckpt}", f"out_dir={tmp_path}"])
    assert generate_text([f"model_dir={tmp_path}", *args]) == text


def test_sampling_depends_on_the_seed_only(ckpt):
    args = [f"ckpt_path={ckpt}", "max_new_tokens=16", "temperature=1.0", "top_p=0.9"]
    a, b, c = (generate_text([*args, f"seed={seed}"]) for seed in (1, 1, 2))
    assert a == b != c


@pytest.mark.parametrize(
    ("main", "argv", "needle"),
    [
        (eval_main, ["max_batches=1"], "ckpt_path is required but not set"),
        (eval_main, ["ckpt_path={ckpt}", "data.bogus=1"], "unknown or invalid key 'data.bogus'"),
        (
            eval_main,
            ["ckpt_path={ckpt}", "data.source=nope"],
            "data.source=nope is not a source; valid: embedded",
        ),
        (eval_main, ["ckpt_path={ckpt}", "split=test"], "split='test' is not valid"),
        (generate_main, ["prompt=x"], "give exactly one of ckpt_path"),
        (
            eval_main,
            ["ckpt_path={ckpt}", "splt=train"],
            "unknown or invalid key 'splt' (did you mean 'split'?)",
        ),
        (
            eval_main,
            ["ckpt_path={ckpt}", "data.batch_siz=1"],
            "unknown or invalid key 'data.batch_siz' (did you mean 'data.batch_size'?)",
        ),
        (
            generate_main,
            ["ckpt_path={ckpt}", "temprature=0"],
            "unknown or invalid key 'temprature' (did you mean 'temperature'?)",
        ),
        (
            export_main,
            ["ckpt_path={ckpt}", "out_dri=x"],
            "unknown or invalid key 'out_dri' (did you mean 'out_dir'?)",
        ),
        (
            plan_main,
            ["trainer.devics=8"],
            "unknown config key 'trainer.devics' (did you mean 'trainer.devices'?)",
        ),
        (generate_main, ["ckpt_path={ckpt}", "temperature=-1"], "temperature=-1"),
        (convert_main, ["src={ckpt}", "out=x", "format=deepspeed", "stage=4"], "stage=4 is not a ZeRO stage"),
        (
            convert_main,
            ["src={ckpt}", "out=x", "format=deepspeed", "precision=fp8"],
            "precision=fp8 is not one of 32-true, bf16-mixed",
        ),
        (
            convert_main,
            ["src={ckpt}", "out=x", "format=dcp", "devices=4"],
            "devices= applies to format=deepspeed only",
        ),
    ],
)
def test_cli_errors(ckpt, main, argv, needle, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main([a.format(ckpt=ckpt) for a in argv])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


@pytest.mark.parametrize(
    ("main", "needles"),
    [
        (export_main, ["parallama-export ckpt_path=<checkpoint> out_dir=<folder>", "out_dir: ???"]),
        (
            eval_main,
            ["parallama-eval ckpt_path=<checkpoint>", "ckpt_path: null", "tasks: []", "max_batches: null"],
        ),
        (generate_main, ["parallama-generate (ckpt_path=<checkpoint>", "temperature: 0.8", "prompt: 'The '"]),
        (plan_main, ["parallama-plan [--config-dir DIR] [gpu_memory_gb=80]", "<parallama-train overrides>"]),
        (convert_main, ["parallama-ckpt convert src=<checkpoint> out=<path>", "format: file"]),
    ],
)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage(main, needles, flag, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main([flag])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert all(n in out for n in needles), out
