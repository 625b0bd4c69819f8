"""Checkpoints and run configs from elsewhere never run code: a pickle whose `__reduce__` calls os.makedirs
is refused by name wherever it hides, and parallama-eval instantiates only parallama's own data classes."""

import os
import pickle
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from omegaconf import OmegaConf

from parallama.checkpoint.formats import verify_checkpoint
from parallama.checkpoint.read import load_checkpoint
from parallama.checkpoint.untrusted import read_dcp_metadata, weights_only_loads
from parallama.errors import ConfigError
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.tokenizer import byte_level

CONFIG = LlamaConfig(
    vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
)


class Payload:
    """Unpickling this creates `marker`: proof that unpickling ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def client_state() -> dict:
    return {
        "hyper_parameters": {"model": asdict(CONFIG)},
        "global_step": 1,
        "tokenizer": byte_level().to_str(),
    }


def weights() -> dict:
    torch.manual_seed(0)
    return {f"model.{k}": v for k, v in Llama(CONFIG).state_dict().items()}


def single_file(root: Path, payload=None) -> Path:
    path = root / "last.ckpt"
    torch.save({"state_dict": weights(), **client_state(), **({"x": payload} if payload else {})}, path)
    return path


def deepspeed_folder(root: Path, payload=None, where: str = "") -> Path:
    """The files a ZeRO-2 checkpoint has (names, client state), with `payload` in the file named `where`."""
    path, tag = root / "last.ckpt", root / "last.ckpt" / "checkpoint"
    tag.mkdir(parents=True)
    (path / "latest").write_text("checkpoint")
    model_states = {"module": None, "param_shapes": [], **client_state()}
    optim_states = {"optimizer_state_dict": {"zero_stage": 2, "partition_count": 1}, "ds_version": "0.19.8"}
    for name, obj in [
        ("mp_rank_00_model_states.pt", model_states),
        ("zero_pp_rank_0_mp_rank_00_optim_states.pt", optim_states),
    ]:
        torch.save({**obj, "x": payload} if payload and where in name else obj, tag / name)
    return path


def dcp_folder(root: Path, payload=None, where: str = "") -> Path:
    """A real torch.distributed.checkpoint folder (one process), with `payload` in `.metadata` or `meta.pt`."""
    path = root / "last.ckpt"
    dcp.save({"state_dict": weights()}, checkpoint_id=path, no_dist=True)
    torch.save(
        {**client_state(), **({"x": payload} if payload and where == "meta.pt" else {})}, path / "meta.pt"
    )
    if payload and where == ".metadata":
        metadata = read_dcp_metadata(path)
        metadata.planner_data = payload
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return path


CASES = {
    "file": (single_file, None),
    "deepspeed-optim_states": (deepspeed_folder, "optim_states.pt"),
    "deepspeed-model_states": (deepspeed_folder, "model_states.pt"),
    "dcp-.metadata": (dcp_folder, ".metadata"),
    "dcp-meta.pt": (dcp_folder, "meta.pt"),
}


def make(case: str, root: Path, marker: Path | None) -> Path:
    build, where = CASES[case]
    payload = Payload(marker) if marker else None
    return build(root, payload) if where is None else build(root, payload, where)


def assert_one_error(proc, *needles):
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert all(n in errors[0] for n in needles), errors[0]


@pytest.mark.parametrize("build", [single_file, deepspeed_folder, dcp_folder])
def test_the_same_checkpoints_without_the_payload_pass(build, tmp_path):
    """The control: so the refusals below are the payload's doing."""
    path = build(tmp_path)
    verify_checkpoint(path)
    if build is not deepspeed_folder:  # hand-made ZeRO files hold no partitions to rebuild weights from
        torch.testing.assert_close(
            load_checkpoint(path).state_dict["norm.weight"], weights()["model.norm.weight"]
        )


@pytest.mark.parametrize("case", CASES)
def test_a_payload_is_refused_by_name_and_never_runs(case, tmp_path):
    marker = tmp_path / "pwned"
    path = make(case, tmp_path, marker)
    for load in (load_checkpoint, verify_checkpoint):  # what the tools read with, and what resuming checks
        with pytest.raises(ConfigError) as excinfo:
            load(path)
        message = str(excinfo.value)
        assert "\n" not in message and message.startswith(f"checkpoint {path}")
        assert (
            "contains os.makedirs, which is not allowed in a checkpoint (possible code execution)" in message
        )
    assert not marker.exists()


# Each tool on two formats, the payload's place varying (every place is covered in-process above).
@pytest.mark.parametrize(
    ("tool", "case"),
    [
        ("parallama.cli.export", "file"),
        ("parallama.cli.export", "dcp-.metadata"),
        ("parallama.cli.evaluate", "deepspeed-model_states"),
        ("parallama.cli.evaluate", "dcp-meta.pt"),
        ("parallama.cli.generate", "deepspeed-optim_states"),
        ("parallama.cli.generate", "file"),
    ],
)
def test_the_tools_refuse_a_payload_in_one_line(tool, case, tmp_path):
    marker = tmp_path / "pwned"
    path = make(case, tmp_path, marker)
    args = [f"ckpt_path={path}"] + ([f"out_dir={tmp_path / 'hf'}"] if tool == "parallama.cli.export" else [])
    proc = run_cli(tool, *args, cwd=tmp_path, check=False)
    assert_one_error(proc, "os.makedirs, which is not allowed in a checkpoint (possible code execution)")
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_verify_checkpoint_names_the_file(tmp_path):
    """What training runs before resuming (Lightning and DeepSpeed unpickle with full pickle)."""
    marker = tmp_path / "pwned"
    path = deepspeed_folder(tmp_path, Payload(marker), "optim_states.pt")
    with pytest.raises(ConfigError) as excinfo:
        verify_checkpoint(path)
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith(f"checkpoint {path}/checkpoint/zero_pp_rank_0")
    assert not marker.exists()


def test_libraries_that_ask_for_full_pickle_get_weights_only(tmp_path):
    """DeepSpeed's zero_to_fp32 and DCP's byte items call torch.load(weights_only=False) themselves."""
    marker = tmp_path / "pwned"
    torch.save({"x": Payload(marker)}, tmp_path / "evil.pt")
    with weights_only_loads([]), pytest.raises(pickle.UnpicklingError, match="GLOBAL os.makedirs"):
        torch.load(tmp_path / "evil.pt", weights_only=False)
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # only inside


def test_a_payload_among_the_distcp_byte_items_is_refused(tmp_path):
    """DCP stores non-tensor state (optimizer param_groups) as pickles inside the .distcp files."""
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt"
    state = {"state_dict": weights(), "optimizer_0": {"param_groups": [{"lr": Payload(marker)}]}}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    with pytest.raises(ConfigError, match=r"__0_0\.distcp contains os\.makedirs"):
        verify_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        (
            "data.source._target_",
            "os.makedirs",
            "data.source._target_=os.makedirs, which parallama-eval does not",
        ),
        ("data._target_", "os.makedirs", "data._target_=os.makedirs, which parallama-eval does not"),
        ("data.source.corpus", "${oc.env:HOME}", "an interpolation; it must hold plain values"),
    ],
)
def test_eval_instantiates_nothing_foreign_from_the_run_config(tmp_path, key, value, needle):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = single_file(run / "checkpoints")
    marker = tmp_path / "pwned"
    config = {
        "data": {
            "_target_": "parallama.data.TextDataModule",
            "source": {"_target_": "parallama.data.sources.embedded", "_partial_": True, "corpus": "prose"},
        }
    }
    node = config
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    if value == "os.makedirs":
        node["name"] = str(marker)
    (run / "resolved_config.yaml").write_text(OmegaConf.to_yaml(config))
    proc = run_cli("parallama.cli.evaluate", f"ckpt_path={ckpt}", cwd=tmp_path, check=False)
    assert_one_error(proc, str(run / "resolved_config.yaml"), needle)
    assert not marker.exists()


def test_training_refuses_to_resume_from_a_payload(tmp_path, data_cache):
    """`parallama-train ckpt_path=...`: Lightning would unpickle the file in full; it is checked first."""
    from conftest import train

    marker = tmp_path / "pwned"
    ckpt = single_file(tmp_path, Payload(marker))
    proc = train(f"ckpt_path={ckpt}", cwd=tmp_path, cache=data_cache, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "not allowed in a checkpoint" in out and "Traceback" not in out
    assert not marker.exists()
