"""`parallama-train` end to end in one process: it trains, checkpoints, logs, samples, and fails cleanly."""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import run_cli, train

from parallama.runtime.launch import STALE_LOCK_SECONDS, use_private_torch_extensions


def read_metrics(run_dir) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_train_writes_checkpoints_logs_config_and_a_sample(tiny_run):
    """Validation before training (the default), a sample at the end, a throughput window of 2: conftest's run."""
    run = tiny_run.dir
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert len(list((run / "checkpoints").glob("step*.ckpt"))) == 1  # the best by val/loss
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "resolved_config.yaml").is_file()
    rows = read_metrics(run)
    val = [(int(r["step"]), float(r["val/loss"])) for r in rows if r["val/loss"]]
    assert val[0][0] == 0 and len(val) >= 2  # the untrained baseline, then validations during training
    assert val[-1][1] < val[0][1]
    assert any(r["train/loss"] for r in rows) and any(r["lr-AdamW/pg1"] for r in rows)
    assert any(r["train/device/items_per_sec"] for r in rows)  # tokens/s from the ThroughputMonitor
    out = tiny_run.output
    assert "sample:" in out and "last checkpoint:" in out and "rank 0/1" in out
    assert f"sample:\n{(run / 'sample.txt').read_text()}" in out  # the whole sample, kept in the run dir


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["trainer.max_stepz=3"],
            "error: unknown config key 'trainer.max_stepz' (did you mean 'trainer.max_steps'?)",
        ),
        (
            ["data.source.corpus=poetry"],
            "error: data.source.corpus='poetry' is not valid; use one of 'prose', 'code'",
        ),
        (
            ["data/source=files", "data.source.paths=/nonexistent/*.txt"],
            "data.source.paths='/nonexistent/*.txt' matches no file",
        ),
        (
            ["tokenizer=bpe", "tokenizer.vocab_size=400", "model.vocab_size=320"],
            "the tokenizer has 400 tokens but model.vocab_size=320",
        ),
    ],
)
def test_bad_input_fails_with_one_line(tmp_path, data_cache, args, message):
    """Also where it is found once the run is under way (a trained tokenizer's size): the run directory it made
    is gone again."""
    proc = train(*args, cwd=tmp_path, cache=data_cache, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert message in out
    assert "Traceback" not in out
    error_lines = [line for line in out.splitlines() if "error:" in line]
    assert len(error_lines) == 1
    assert not (tmp_path / "logs").exists()


def test_missing_checkpoint_is_reported(tmp_path, data_cache):
    proc = train("ckpt_path=/nonexistent/last.ckpt", cwd=tmp_path, cache=data_cache, check=False)
    assert proc.returncode == 2
    assert "ckpt_path=/nonexistent/last.ckpt does not exist" in proc.stdout + proc.stderr


def test_help_lists_groups(tmp_path):
    proc = run_cli("parallama.cli.train", "--help", cwd=tmp_path)
    assert "strategy: auto, ddp, ddp_sharded, ddp_spawn, deepspeed, fsdp" in proc.stdout


def test_log_file_progress_and_the_config_in_the_run_dir(tiny_run):
    """stdout is a pipe here, as in a log file: progress comes as lines (conftest's run prints one every 2 steps);
    the console names the overrides and where the whole config is, and does not print it."""
    out = tiny_run.output
    assert "step 2/4 (50%)  train/loss" in out and "step 4/4 (100%)" in out
    (overrides,) = [line for line in out.splitlines() if "] - overrides: " in line]
    assert " trainer.max_steps=4 " in overrides
    assert overrides.endswith(
        f"the whole config: {tiny_run.dir}/resolved_config.yaml (print_config=true prints it)"
    )
    assert f"output_dir: {tiny_run.dir}" in (tiny_run.dir / "resolved_config.yaml").read_text()
    assert f"output_dir: {tiny_run.dir}" not in out


def test_a_default_run_prints_at_most_40_lines(tmp_path, data_cache):
    """`parallama-train trainer.max_steps=20` printed 187 lines, 154 of them the config: now the overrides and
    the run's facts. A smaller model and data than the default's print the same lines (only numbers differ)."""
    small = [
        "data.batch_size=4",
        "data.seq_len=64",
        "data.source.max_documents=12",
        "trainer.limit_val_batches=2",
    ]
    small += ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2"]
    proc = run_cli(
        "parallama.cli.train",
        "trainer.max_steps=20",
        "trainer.accelerator=cpu",
        *small,
        f"paths.cache_dir={data_cache}",
        cwd=tmp_path,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) <= 40, "\n".join(lines)
    assert any("] - run: llama of 2 layers x 64, vocabulary 320 (tokenizer 260)" in line for line in lines)


def test_help_and_typos_answer_before_torch_loads(tmp_path):
    code = "import sys, parallama.cli.train; print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_a_stale_extension_build_lock_is_removed(tmp_path, monkeypatch, caplog):
    """A DeepSpeed op build killed midway leaves `<op>/lock`, and every later run waited on it forever, silently
    (found 3/3 after a kill -9 during the first build, the lock minutes old): a lock that no live build holds is
    removed in one line; a build that just began, or one still working in its folder, keeps its lock."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    logger = logging.getLogger("parallama")  # an in-process Hydra app earlier in the session may have
    monkeypatch.setattr(logger, "disabled", False)  # disabled it (logging.config, disable_existing_loggers)
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.WARNING, logger="parallama")
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock"
    building = (
        tmp_path / "py311_cpu" / "deepspeed_ccl_comm" / "lock"
    )  # torch's default layout, one level down
    for lock in (stale, fresh, building):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_LOCK_SECONDS - 60
    for lock in (stale, building):
        os.utime(lock, (old, old))
    ninja = subprocess.Popen(["sleep", "30"], cwd=building.parent)  # a build at work in its folder
    try:
        use_private_torch_extensions()
    finally:
        ninja.kill()
        ninja.wait()
    assert not stale.exists() and fresh.exists() and building.exists()
    (line,) = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert f"removed {stale}" in line and "no process builds there" in line and "\n" not in line


def test_a_lock_left_moments_ago_is_removed_once_stale_while_deepspeed_starts(tmp_path, monkeypatch):
    """A build killed seconds before the run started leaves a lock too young to call stale at start: the DeepSpeed
    strategy watches the locks while it may build or wait (runtime.launch.STALE_LOCK_SECONDS, shortened here)."""
    from parallama.parallel.strategies.deepspeed import watch_build_locks
    from parallama.runtime import launch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "STALE_LOCK_SECONDS", 0.3)
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    watch_build_locks(seconds=1, every=0.1)
    assert not lock.exists()


def test_each_python_environment_gets_its_own_extension_dir(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    use_private_torch_extensions()
    assert hashlib.sha256(sys.prefix.encode()).hexdigest()[:10] in os.environ["TORCH_EXTENSIONS_DIR"]


def test_last_checkpoint_every_n_steps_and_every_t(tiny_run):
    """Lightning's ModelCheckpoint refuses both; `last_checkpoint` takes both (the config says "and/or"):
    conftest's run sets both."""
    config = (tiny_run.dir / ".hydra" / "config.yaml").read_text()
    assert "every_n_train_steps: 3" in config and "seconds: 1" in config
    assert (tiny_run.dir / "checkpoints" / "last.ckpt").is_file()


def test_validation_off_is_said_at_start_and_in_the_report(tmp_path, data_cache):
    """data.val_fraction=0 trains without validation: one info line says so before training, and the report's
    metrics line says why it is empty (it used to be a silent `final metrics: {}`)."""
    proc = train("data.val_fraction=0", "sample.max_new_tokens=0", cwd=tmp_path, cache=data_cache)
    lines = (proc.stdout + proc.stderr).splitlines()
    said = [i for i, line in enumerate(lines) if "validation is off (data.val_fraction=0" in line]
    assert len(said) == 1, lines[-40:]
    fit_starts = next(
        i for i, line in enumerate(lines) if line.startswith("Trainable params")
    )  # model summary
    assert said[0] < fit_starts
    assert any("final metrics:   {} (validation was off: data.val_fraction=0" in line for line in lines)


def test_console_csv_and_checkpoint_names_number_steps_alike(tiny_run):
    """ "step N" is "after N optimizer steps" everywhere: the console's validation lines, metrics.csv's rows
    (Lightning numbers them by the steps before the one that logged them) and the checkpoint names."""
    rows = read_metrics(tiny_run.dir)
    csv_val = {int(r["step"]): f"{float(r['val/loss']):.4f}" for r in rows if r["val/loss"]}
    console = dict(re.findall(r"\] - step (\d+)  val/loss (\S+)", tiny_run.output))
    assert {int(k): v for k, v in console.items()} == csv_val and sorted(csv_val) == [0, 2, 4]
    assert sorted(int(r["step"]) for r in rows if r["train/loss"]) == [1, 2, 3, 4]  # max_steps=4
    (best,) = (tiny_run.dir / "checkpoints").glob("step*.ckpt")
    assert int(best.stem.removeprefix("step")) in csv_val
    assert float(csv_val[int(best.stem.removeprefix("step"))]) == min(float(v) for v in csv_val.values())


def test_a_run_prints_no_known_noise(tiny_run):
    """Lightning's INFO lines once (they were printed plainly and again through Hydra's format), no "`weights_only`
    was not set" at each checkpoint save, no model summary FLOPs (always 0), no LeafSpec FutureWarning."""
    out = tiny_run.output
    assert [line for line in out.splitlines() if line.startswith("INFO: ")] == []
    assert out.count("`Trainer.fit` stopped: `max_steps=4` reached.") == 1
    assert (tiny_run.dir / "train.log").read_text().count(
        "`Trainer.fit` stopped"
    ) == 1  # the log file keeps it
    assert "weights_only" not in out
    assert "Trainable params" in out and "FLOPs" not in out
    assert "LeafSpec" not in out and "FutureWarning" not in out


def test_debug_fdr_does_what_it_says(tmp_path, data_cache):
    """debug=fdr: one train batch, then one val batch (none before training), no checkpoints or metrics logs, and
    a report that says so (it printed `best checkpoint: - (val/loss None)` and `DummyLogger: None`)."""
    run = tmp_path / "run"
    proc = train("debug=fdr", "sample.max_new_tokens=0", cwd=tmp_path, cache=data_cache, run_dir=run)
    out = proc.stdout + proc.stderr
    assert re.findall(r"\] - step (\d+)  val/loss", out) == ["1"]  # after the one training batch only
    assert "best checkpoint" not in out and "DummyLogger" not in out
    assert "fast_dev_run:    no checkpoints or metrics logged" in out
    assert not (run / "checkpoints").exists() and not (run / "csv").exists()
    assert sorted(p.name for p in run.iterdir()) == [".hydra", "resolved_config.yaml", "train.log"]
