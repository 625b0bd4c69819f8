"""Where parallama keeps its own code beside a library that seems to do the job: each test shows the library
getting parallama's case wrong, and the kept code's docstring names the test.

- config schema (rules.py, config/schema.py) against OmegaConf structured configs and a Hydra ConfigStore schema;
- the `devices` sweep launcher (sweeps/launcher.py) against Hydra's joblib and submitit-local launchers;
- starting a run's ranks (runtime/launch.py) against Lightning's launcher, which re-runs `sys.argv`;
- `locate` (config/parts.py) against Hydra's `get_object`, the atomic checkpoint write (checkpoint/atomic.py)
  against Lightning's TorchCheckpointIO;
- Muon as one optimizer (training/muon.py) against torch.optim.Muon.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from hydra.utils import get_object
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import OmegaConf
from omegaconf.errors import ConfigValueError, ValidationError

from parallama.config import schema
from parallama.config.parts import locate_target
from parallama.errors import ConfigError

# --- the config schema ------------------------------------------------------------------------------------------


def refusal(cfg: dict) -> str:
    with pytest.raises(ConfigError) as err:
        schema.check_schema(OmegaConf.create(cfg))
    return str(err.value)


def test_omegaconf_cannot_hold_the_trainer_schema():
    """trainer.devices is a count, auto or a list of ids: OmegaConf refuses the class itself (no Union with a
    list), so the Trainer node could not be a structured config at all."""
    with pytest.raises(ConfigValueError, match=r"Unions of containers are not supported:\ndevices"):
        OmegaConf.structured(schema.Trainer)


@pytest.mark.parametrize(
    "cls, path, value, line",
    [
        (schema.Data, "data.batch_size", 0, "data.batch_size=0 is not valid; use an integer >= 1 or null"),
        (schema.Data, "data.val_fraction", 1.5, "data.val_fraction=1.5 is not valid; use a number in [0, 1)"),
        (schema.Run, "compile", "max", "compile='max' is not valid; use one of 'auto' or true or false"),
        (
            schema.Run,
            "float8",
            "fp8",
            "float8='fp8' is not valid; use one of 'tensorwise', 'rowwise' or null",
        ),
    ],
    ids=["range", "interval", "union-choice", "choice"],
)
def test_omegaconf_checks_no_range_or_choice(cls, path, value, line):
    """A structured config checks the type only: a batch of 0, a fraction above 1, a `compile: bool | str` or
    `float8: str | None` outside its choices all pass (choices would need an Enum, whose members then replace the
    strings every reader compares against)."""
    key = path.rpartition(".")[2]
    assert OmegaConf.merge(OmegaConf.structured(cls), {key: value})[key] == value
    assert refusal(OmegaConf.to_container(OmegaConf.from_dotlist([f"{path}={value}"]))) == line


def test_omegaconf_changes_values_and_words_its_refusal_in_three_lines():
    """`data.packing=1` (or `yes`) silently becomes true; `maybe` is refused in three lines that name the key
    but not what is valid. The schema refuses both in one line saying what is."""
    data = OmegaConf.structured(schema.Data)
    assert OmegaConf.merge(data, {"packing": 1}).packing is True
    assert OmegaConf.merge(data, {"packing": "yes"}).packing is True
    with pytest.raises(ValidationError) as err:
        OmegaConf.merge(data, {"packing": "maybe"})
    assert str(err.value).splitlines() == [
        "Value 'maybe' is not a valid bool (type str)",
        "    full_key: packing",
        "    object_type=Data",
    ]
    assert refusal({"data": {"packing": 1}}) == "data.packing=1 is not valid; use true or false"
    assert refusal({"data": {"packing": "maybe"}}) == "data.packing='maybe' is not valid; use true or false"


def test_a_configstore_schema_words_it_as_an_override_that_did_not_merge():
    """The same class as a Hydra ConfigStore schema: a batch of 0 composes, and a bad bool is "Error merging
    override data.packing=maybe", the reason in its cause."""
    ConfigStore.instance().store(name="library_gaps_data", node={"data": schema.Data})
    with initialize(version_base="1.3"):
        assert compose("library_gaps_data", overrides=["data.batch_size=0"]).data.batch_size == 0
        with pytest.raises(ConfigCompositionException) as err:
            compose("library_gaps_data", overrides=["data.packing=maybe"])
    assert str(err.value) == "Error merging override data.packing=maybe"


# --- launchers ----------------------------------------------------------------------------------------------------

# A Hydra app whose job records what a job of it would run to start its other ranks: parallama's `job_command`
# (the module that `__main__` is) and, with `lightning=true`, Lightning's (its `sys.argv`).
APP = """
import json, os, sys
import hydra
from hydra.core.hydra_config import HydraConfig
from parallama.runtime.launch import job_command

@hydra.main(version_base="1.3", config_path=".", config_name="config")
def main(cfg):
    hc = HydraConfig.get()
    seen = {
        "main": getattr(sys.modules["__main__"].__spec__, "name", None),
        "parallama": job_command(hc, list(hc.overrides.task), hc.runtime.output_dir),
        "left_by": os.environ.get("LEFT_BY"),  # what an earlier job in this process set
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if cfg.lightning:  # torch-free otherwise
        from lightning.fabric.strategies.launchers.subprocess_script import _hydra_subprocess_cmd
        seen["lightning"] = _hydra_subprocess_cmd(local_rank=1)[0]
    os.environ["LEFT_BY"] = str(cfg.x)
    with open(os.path.join(cfg.out, f"{cfg.x}.json"), "w") as f:
        json.dump(seen, f)

if __name__ == "__main__":
    main()
"""


def sweep(tmp_path, jobs: int, *args: str) -> dict[int, dict]:
    """Runs the app's sweep over x=1..jobs with `args`; what each job recorded, by x."""
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text(f"x: 0\nlightning: false\nout: {tmp_path}\n")
    xs = range(1, jobs + 1)
    args = ("-m", f"x={','.join(map(str, xs))}", f"hydra.sweep.dir={tmp_path}/sweep", *args)
    subprocess.run(
        [sys.executable, "app.py", *args], cwd=tmp_path, check=True, capture_output=True, timeout=120
    )
    return {x: json.loads((tmp_path / f"{x}.json").read_text()) for x in xs}


def test_joblib_jobs_run_in_joblib_workers_that_share_their_environment(tmp_path):
    """hydra/launcher=joblib (sweeps/launcher.py): four jobs on two workers. A worker's `__main__` is loky's
    worker module, so the command a ddp trial would start its other ranks with runs joblib, not the app; a job
    after the first on its worker sees what the one before left in os.environ; no job is given devices of its
    own. (With n_jobs=1 joblib runs the jobs in the sweep's own process, as hydra/launcher=basic does.)"""
    seen = sweep(tmp_path, 4, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    for job in seen.values():
        assert job["main"] == "joblib.externals.loky.backend.popen_loky_posix"
        assert job["parallama"][1:3] == ["-m", "joblib.externals.loky.backend.popen_loky_posix"]
        assert job["cuda"] is None
    assert sum(job["left_by"] is not None for job in seen.values()) >= 2


def test_submitit_local_jobs_run_submitit_and_all_get_the_same_gpus(tmp_path):
    """hydra/launcher=submitit_local (sweeps/launcher.py): each job's `__main__` is submitit's, and every job of
    the sweep is handed the same GPUs (the first gpus_per_node), whether or not they are free."""
    seen = sweep(tmp_path, 2, "hydra/launcher=submitit_local", "hydra.launcher.gpus_per_node=1")
    for job in seen.values():
        assert job["main"] == "submitit.core._submit"
        assert job["parallama"][1:3] == ["-m", "submitit.core._submit"]
        assert job["cuda"] == "0"


def test_lightning_starts_a_sweep_jobs_ranks_with_the_whole_sweep(tmp_path):
    """Under Hydra's in-process launcher (hydra/launcher=basic) `sys.argv` is the sweep's: the command Lightning's
    launcher starts rank 1 with is `-m x=1,2` again, a whole sweep in every rank (runtime/launch.py); the one
    parallama starts it with (`job_command`) runs this job alone."""
    seen = sweep(tmp_path, 2, "hydra/launcher=basic", "lightning=true")
    for x, job in seen.items():
        assert "-m" in job["lightning"] and "x=1,2" in job["lightning"]
        assert "-m" not in job["parallama"] and f"x={x}" in job["parallama"]
        assert job["parallama"][-1] == "hydra.mode=RUN"


# --- other parts ------------------------------------------------------------------------------------------------


def test_hydras_get_object_logs_an_error_and_raises_three_lines(caplog):
    """config/parts.py `locate`: Hydra's `get_object` logs its own ERROR report, then raises an ImportError of three
    lines; `locate_target` says it in one line naming the key."""
    with pytest.raises(ImportError) as err:
        get_object("parallama.nope.Thing")
    assert len(str(err.value).splitlines()) == 3
    assert [r.levelname for r in caplog.records if r.name == "hydra.utils"] == ["ERROR"]
    with pytest.raises(ConfigError) as err:
        locate_target("parallama.nope.Thing", "optimizer._target_")
    assert str(err.value) == (
        "optimizer._target_=parallama.nope.Thing cannot be imported (No module named 'parallama.nope')"
    )


def test_lightnings_checkpoint_io_writes_in_tmpdir_then_moves(tmp_path, monkeypatch):
    """checkpoint/atomic.py: Lightning's TorchCheckpointIO writes the checkpoint to a temp file in $TMPDIR and
    `shutil.move`s it to its target, a copy where $TMPDIR is another filesystem (a kill mid-copy truncates
    last.ckpt; a kill mid-write leaves a checkpoint-sized temp file there)."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read $TMPDIR
    moves, move = [], shutil.move

    def spy(src, dst, *args, **kwargs):
        moves.append((Path(src).parent, Path(dst)))
        return move(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "move", spy)
    target = tmp_path / "checkpoints" / "last.ckpt"
    TorchCheckpointIO().save_checkpoint({"w": torch.zeros(4)}, target)
    assert moves == [(tmpdir, target)] and target.is_file()


# --- Muon -------------------------------------------------------------------------------------------------------


def test_torchs_muon_takes_only_matrices_so_it_cannot_be_the_one_optimizer():
    """training/muon.py keeps torch.optim.Muon's update (test_muon.py::test_one_step_is_torchs_muon_and_adamw_run_
    separately) but is one optimizer over every parameter: torch's refuses the norms' vectors and the embeddings'
    AdamW keys, so it would need a second optimizer (Lightning's manual optimization) beside it."""
    vector = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match="only supports 2D parameters"):
        torch.optim.Muon([vector])
