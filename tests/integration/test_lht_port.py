"""lightning-hydra-template's own test suite, ported to parallama with the fewest renames.

Source: github.com/ashleve/lightning-hydra-template (MIT), tests/conftest.py, test_configs.py, test_train.py,
test_sweeps.py and test_eval.py. What had to change, and why:
- `src.train.train` -> `parallama.app.run.train`, `src.eval.evaluate` -> `parallama.cli.evaluate.evaluate` (it
  returns the metrics only: it builds no Trainer); configs come from parallama's conf/ (`CONF_DIR`).
- eval.yaml has no `model`/`trainer`: the model and its shape come from the checkpoint, and evaluation is a
  plain loop. Train's `test/acc` is the final `val/loss`, eval's is `loss` (on the same batches).
- Metrics: LHT's MNIST model logs `*/acc`; a language model logs `*/loss`, which must fall where acc rises.
- Checkpoint names: LHT's `epoch_000.ckpt` is parallama's `step0000001.ckpt` (the best by val/loss).
- With 2 ranks `limit_train_batches=0.01` -> 0.05: the embedded corpus is small (110 train and 3 validation
  batches); `limit_val_batches=0.1` is LHT's own (a fraction validates at least one batch in parallama, where
  Lightning refuses one that selects none). LHT's `limit_test_batches`, `data.pin_memory` and `extras.*` have no
  counterpart.
- `trainer.strategy="ddp_spawn"` -> `trainer=ddp_sim`: the strategy is its own config group here.
- `val_check_interval=0.5` as in LHT: a fraction sets `check_val_every_n_epoch=1` (parallama's default interval
  counts batches across epochs); the test also asks that it validated mid-epoch.
- Sweeps: `model.optimizer.lr` -> `optimizer.lr`, `hparams_search=mnist_optuna` -> `lr_optuna`, `+trainer.limit_*`
  -> `++` (the keys exist in parallama's trainer config), and `experiment=glob(*)` runs on the embedded corpus
  (offline) at the tiny width (but `mixture`, which mixes the embedded corpora without a `data/source`); the
  presets for many GPUs or nodes are `experiment=plan/<name>`, outside the glob.
- As in LHT, `slow` marks the long cases (all epochs, multi-process sweeps); the default suite runs the rest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import hydra
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from parallama import CONF_DIR
from parallama.app.run import train
from parallama.cli.evaluate import evaluate

RunIfGPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


# --- conftest.py -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cfg_train_global(data_cache) -> DictConfig:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train.yaml", return_hydra_config=True, overrides=[])

        with open_dict(cfg):
            cfg.paths.root_dir = str(Path.cwd())
            cfg.paths.cache_dir = str(data_cache)  # shared tokenized corpus (LHT downloads MNIST once)
            cfg.trainer.max_epochs = 1
            cfg.trainer.limit_train_batches = 0.01
            cfg.trainer.limit_val_batches = 0.1
            cfg.trainer.accelerator = "cpu"
            cfg.trainer.devices = 1
            cfg.data.num_workers = 0
            cfg.logger = None

    return cfg


@pytest.fixture(scope="module")
def cfg_eval_global(data_cache) -> DictConfig:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="eval.yaml", return_hydra_config=True, overrides=["ckpt_path=."])

        with open_dict(cfg):
            cfg.paths.root_dir = str(Path.cwd())
            cfg.paths.cache_dir = str(data_cache)
            cfg.data.num_workers = 0

    return cfg


@pytest.fixture(scope="function")
def cfg_eval(cfg_eval_global: DictConfig, tmp_path: Path) -> DictConfig:
    cfg = cfg_eval_global.copy()

    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
        cfg.paths.log_dir = str(tmp_path)

    yield cfg

    GlobalHydra.instance().clear()


@pytest.fixture(scope="function")
def cfg_train(cfg_train_global: DictConfig, tmp_path: Path) -> DictConfig:
    cfg = cfg_train_global.copy()

    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
        cfg.paths.log_dir = str(tmp_path)

    yield cfg

    GlobalHydra.instance().clear()


# --- test_configs.py ---------------------------------------------------------------------------------------


def test_train_config(cfg_train: DictConfig) -> None:
    assert cfg_train
    assert cfg_train.data
    assert cfg_train.model
    assert cfg_train.trainer

    HydraConfig().set_config(cfg_train)

    hydra.utils.instantiate(cfg_train.data)
    hydra.utils.instantiate(cfg_train.model)
    hydra.utils.instantiate(cfg_train.trainer)


def test_eval_config(cfg_eval: DictConfig) -> None:
    assert cfg_eval
    assert cfg_eval.data

    HydraConfig().set_config(cfg_eval)

    hydra.utils.instantiate(cfg_eval.data)


# --- test_eval.py ------------------------------------------------------------------------------------------


def test_train_eval(tmp_path: Path, cfg_train: DictConfig, cfg_eval: DictConfig) -> None:
    assert str(tmp_path) == cfg_train.paths.output_dir == cfg_eval.paths.output_dir

    with open_dict(cfg_train):
        cfg_train.trainer.max_epochs = 1

    HydraConfig().set_config(cfg_train)
    train_metric_dict, _ = train(cfg_train)

    assert "last.ckpt" in os.listdir(tmp_path / "checkpoints")

    with open_dict(cfg_eval):
        cfg_eval.ckpt_path = str(tmp_path / "checkpoints" / "last.ckpt")
        cfg_eval.max_batches = 1  # what limit_val_batches=0.1 of 3 batches validated in training (at least 1)

    HydraConfig().set_config(cfg_eval)
    test_metric_dict = evaluate(cfg_eval)

    assert test_metric_dict["loss"] > 0.0
    assert abs(train_metric_dict["val/loss"].item() - test_metric_dict["loss"]) < 0.001


# --- test_train.py -----------------------------------------------------------------------------------------


def test_train_fast_dev_run(cfg_train: DictConfig) -> None:
    HydraConfig().set_config(cfg_train)
    with open_dict(cfg_train):
        cfg_train.trainer.fast_dev_run = True
        cfg_train.trainer.accelerator = "cpu"
    train(cfg_train)


@RunIfGPU
def test_train_fast_dev_run_gpu(cfg_train: DictConfig) -> None:
    HydraConfig().set_config(cfg_train)
    with open_dict(cfg_train):
        cfg_train.trainer.fast_dev_run = True
        cfg_train.trainer.accelerator = "gpu"
    train(cfg_train)


@RunIfGPU
@pytest.mark.slow
def test_train_epoch_gpu_amp(cfg_train: DictConfig) -> None:
    HydraConfig().set_config(cfg_train)
    with open_dict(cfg_train):
        cfg_train.trainer.max_epochs = 1
        cfg_train.trainer.accelerator = "cpu"
        cfg_train.trainer.precision = "16-mixed"
    train(cfg_train)


def test_train_epoch_double_val_loop(cfg_train: DictConfig) -> None:
    HydraConfig().set_config(cfg_train)
    with open_dict(cfg_train):
        cfg_train.trainer.max_epochs = 1
        cfg_train.trainer.val_check_interval = 0.5
        cfg_train.trainer.limit_train_batches = (
            4  # (LHT's 1% of an epoch is 1 batch here: nothing in between)
        )
    _, objects = train(cfg_train)
    validations = objects["trainer"].fit_loop.epoch_loop.val_loop.batch_progress.total.completed
    assert validations == 2  # after batch 2 of 4 (mid-epoch) and at the end, 1 batch each (limit 0.1)


def test_train_ddp_sim(cfg_train: DictConfig, tmp_path: Path, data_cache, monkeypatch) -> None:
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # Lightning sets them in this process: undone after the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train.yaml", return_hydra_config=True, overrides=["trainer=ddp_sim"])
    with open_dict(cfg):
        for key in ("paths", "data", "logger"):
            cfg[key] = cfg_train[key]
        cfg.trainer.limit_train_batches = 2  # the template's 5% of an epoch is 12 batches here
        cfg.trainer.limit_val_batches = cfg_train.trainer.limit_val_batches
        cfg.trainer.max_epochs = 2
        cfg.trainer.accelerator = "cpu"
        cfg.trainer.devices = 2
        cfg.validate_before_training = False  # one spawn of the ranks (fit), not two (validate, then fit)
    HydraConfig().set_config(cfg)
    metric_dict, _ = train(cfg)
    assert "last.ckpt" in os.listdir(tmp_path / "checkpoints")


def test_train_resume(tmp_path: Path, cfg_train: DictConfig) -> None:
    with open_dict(cfg_train):
        cfg_train.trainer.max_epochs = 1

    HydraConfig().set_config(cfg_train)
    metric_dict_1, _ = train(cfg_train)

    files = os.listdir(tmp_path / "checkpoints")
    assert "last.ckpt" in files
    assert "step0000001.ckpt" in files

    with open_dict(cfg_train):
        cfg_train.ckpt_path = str(tmp_path / "checkpoints" / "last.ckpt")
        cfg_train.trainer.max_epochs = 2

    metric_dict_2, _ = train(cfg_train)

    files = os.listdir(tmp_path / "checkpoints")
    assert "step0000002.ckpt" in files
    assert "step0000003.ckpt" not in files

    assert metric_dict_1["train/loss"] > metric_dict_2["train/loss"]
    assert metric_dict_1["val/loss"] > metric_dict_2["val/loss"]


# --- test_sweeps.py ----------------------------------------------------------------------------------------

overrides = ["logger=[]"]


def run_sh_command(command: list[str], cache: Path, cwd: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "LOCAL_RANK", "RANK", "WORLD_SIZE"))
    }
    env.update(OMP_NUM_THREADS="1", WANDB_DIR=str(cwd), WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "parallama.cli.train", *command, f"paths.cache_dir={cache}"]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(command)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.slow
def test_experiments(tmp_path: Path, data_cache) -> None:
    command = [
        "-m",
        "experiment=glob(*,exclude=mixture)",  # mixture has no data/source to override (test_mixture runs it)
        "hydra.sweep.dir=" + str(tmp_path),
        "++trainer.fast_dev_run=true",
        "data/source=embedded",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
        "model.hidden_size=192",  # divisible by article_180m's 12 heads
        "model.intermediate_size=384",
        "model.num_hidden_layers=2",
        "data.batch_size=8",  # article_180m's null is 64 samples in one micro-batch on one device
    ] + overrides
    run_sh_command(command, data_cache, tmp_path)


@pytest.mark.slow  # as in LHT; test_sweeps.py runs multirun (ddp, ddp_spawn, deepspeed) in the default suite
def test_hydra_sweep(tmp_path: Path, data_cache) -> None:
    command = [
        "-m",
        "hydra.sweep.dir=" + str(tmp_path),
        "optimizer.lr=0.005,0.01",
        "++trainer.fast_dev_run=true",
    ] + overrides

    run_sh_command(command, data_cache, tmp_path)


@pytest.mark.slow
def test_hydra_sweep_ddp_sim(tmp_path: Path, data_cache) -> None:
    command = [
        "-m",
        "hydra.sweep.dir=" + str(tmp_path),
        "trainer=ddp_sim",
        "trainer.max_epochs=3",
        "++trainer.limit_train_batches=0.05",
        "++trainer.limit_val_batches=0.5",
        "optimizer.lr=0.005,0.01,0.02",
    ] + overrides
    run_sh_command(command, data_cache, tmp_path)


@pytest.mark.slow  # as in LHT; test_sweeps.py runs Optuna trials under ddp in the default suite
def test_optuna_sweep(tmp_path: Path, data_cache) -> None:
    command = [
        "-m",
        "hparams_search=lr_optuna",
        "hydra.sweep.dir=" + str(tmp_path),
        "hydra.sweeper.n_trials=10",
        "hydra.sweeper.sampler.n_startup_trials=5",
        "++trainer.fast_dev_run=true",
    ] + overrides
    run_sh_command(command, data_cache, tmp_path)


@pytest.mark.slow
def test_optuna_sweep_ddp_sim_wandb(tmp_path: Path, data_cache) -> None:
    command = [
        "-m",
        "hparams_search=lr_optuna",
        "hydra.sweep.dir=" + str(tmp_path),
        "hydra.sweeper.n_trials=5",
        "trainer=ddp_sim",
        "trainer.max_epochs=3",
        "++trainer.limit_train_batches=0.05",
        "++trainer.limit_val_batches=0.5",
        "logger=wandb",
    ]
    run_sh_command(command, data_cache, tmp_path)
