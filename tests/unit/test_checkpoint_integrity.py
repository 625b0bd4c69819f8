"""Checksums of every checkpoint format, checked before a byte is used (checkpoint/integrity.py), and what
`ckpt_path` resolves to (checkpoint/resume.py): this run's newest intact checkpoint, never another run's.

In-process and on hand-made checkpoints; the real runs' checkpoints (ddp, FSDP, DeepSpeed at 2 ranks) are
checked in tests/distributed/test_universal_resume.py, the CLIs in tests/integration/test_resume.py."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from corruption import flip_a_tensor_byte

from parallama.checkpoint import integrity
from parallama.checkpoint.atomic import AtomicCheckpointIO, AtomicFolderCheckpoints, save_file
from parallama.checkpoint.formats import verify_checkpoint
from parallama.checkpoint.read import load_checkpoint
from parallama.checkpoint.resume import resolve_ckpt_path
from parallama.errors import ConfigError, Preempted
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.runtime.faults import last_checkpoint_note, resume_overrides
from parallama.tokenizer import byte_level

CONFIG = LlamaConfig(
    vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
)


def checkpoint(step: int = 1) -> dict:
    torch.manual_seed(step)
    weights = {f"model.{k}": v for k, v in Llama(CONFIG).state_dict().items()}
    client = {"hyper_parameters": {"model": asdict(CONFIG)}, "global_step": step}
    return {"state_dict": weights, **client, "tokenizer": byte_level().to_str()}


class _DCPWriter:
    """What FSDP2's strategy does with the path it is given, in one process (test_checkpoint_io's stand-in)."""

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        state = dict(checkpoint)
        dcp.save({"state_dict": state.pop("state_dict")}, checkpoint_id=str(filepath), no_dist=True)
        torch.save(state, filepath / "meta.pt")


class OneProcess:
    is_global_zero = True

    def barrier(self, name=None):
        pass


class DCPRun(OneProcess, AtomicFolderCheckpoints, _DCPWriter):
    pass


class _FullStateWriter:
    """FSDP with save_distributed_checkpoint=false: rank 0 writes one file through the checkpoint IO."""

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        AtomicCheckpointIO().save_checkpoint(checkpoint, filepath)


class FullStateRun(OneProcess, AtomicFolderCheckpoints, _FullStateWriter):
    pass


def one_error(call) -> str:
    with pytest.raises(ConfigError) as excinfo:
        call()
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_a_single_file_carries_its_checksum_and_a_flipped_tensor_byte_is_named(tmp_path):
    path = tmp_path / "last.ckpt"
    save_file(checkpoint(), path)
    assert integrity.has_checksums(path) and integrity.problem(path) is None
    flipped = flip_a_tensor_byte(path)
    for read in (load_checkpoint, verify_checkpoint, integrity.verify):  # eval/export, convert, resume
        message = one_error(lambda: read(path))  # noqa: B023
        assert message.startswith(f"checkpoint {flipped} is corrupt: its sha256 differs from the one ")
    path.write_bytes(path.read_bytes()[:1000])
    assert "is 1000 bytes but was written with" in one_error(lambda: integrity.verify(path))


def test_a_kill_between_the_checksum_and_the_rename_leaves_a_pair_that_checks(tmp_path, monkeypatch):
    """The sidecar is written first and names the content it replaces too: whichever of the two renames a kill
    falls between, the file on disk checks."""
    path = tmp_path / "last.ckpt"
    save_file(checkpoint(1), path)
    replace = os.replace

    def killed_at_the_file(src, dst):
        if str(dst) == str(path):
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_file)
    with pytest.raises(KeyboardInterrupt):
        save_file(checkpoint(2), path)
    monkeypatch.setattr(os, "replace", replace)
    assert integrity.problem(path) is None and torch.load(path)["global_step"] == 1
    save_file(checkpoint(3), path)
    assert integrity.problem(path) is None and torch.load(path)["global_step"] == 3


def test_a_dcp_folder_carries_its_checksums_and_a_missing_shard_is_one_line(tmp_path):
    path = tmp_path / "last.ckpt"
    DCPRun().save_checkpoint(checkpoint(), path)
    assert sorted(integrity._read_manifest(path / "checksums.json")["files"]) == [
        ".metadata",
        "__0_0.distcp",
        "meta.pt",
    ]
    assert load_checkpoint(path).meta["global_step"] == 1
    flipped = flip_a_tensor_byte(path)
    assert one_error(lambda: load_checkpoint(path)).startswith(f"checkpoint {flipped} is corrupt")
    flipped.unlink()
    message = one_error(lambda: verify_checkpoint(path))
    assert message == f"checkpoint {flipped} is missing (listed in {path / 'checksums.json'})"
    (path / "checksums.json").unlink()  # as written before checksums: still one line, not "[Errno 2]"
    assert one_error(lambda: verify_checkpoint(path)).startswith(f"checkpoint {flipped} is missing")


def test_a_full_state_file_written_as_partial_keeps_its_checksum_when_renamed(tmp_path):
    path = tmp_path / "last.ckpt"
    for step in (1, 2):
        FullStateRun().save_checkpoint(checkpoint(step), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.checksums.json"]
    assert integrity.problem(path) is None and load_checkpoint(path).meta["global_step"] == 2


def test_a_folder_without_checksums_loads_with_one_note(tmp_path, caplog):
    path = tmp_path / "old.ckpt"
    torch.save(checkpoint(), path)
    with caplog.at_level(logging.WARNING, logger="parallama"):
        for _ in range(2):
            load_checkpoint(path)
    notes = [r.getMessage() for r in caplog.records if "checksums" in r.getMessage()]
    assert notes == [
        f"checkpoint {path} carries no checksums (written before they were recorded): not verified"
    ]


def test_an_exported_folder_is_checked_when_it_has_checksums(tmp_path):
    from parallama.checkpoint.read import load_model
    from parallama.cli.export import main as export_main

    save_file(checkpoint(), tmp_path / "last.ckpt")
    export_main([f"ckpt_path={tmp_path / 'last.ckpt'}", f"out_dir={tmp_path / 'hf'}"])
    assert "model.safetensors" in integrity._read_manifest(tmp_path / "hf" / "checksums.json")["files"]
    load_model(model_dir=str(tmp_path / "hf"))
    flipped = flip_a_tensor_byte(tmp_path / "hf")
    message = one_error(lambda: load_model(model_dir=str(tmp_path / "hf")))
    assert message.startswith(f"checkpoint {flipped} is corrupt")


def run_dir(root, *names: str, corrupt: str | None = None):
    """A run directory holding the checkpoints `names` (written in that order, a second apart)."""
    folder = root / "checkpoints"
    for age, name in enumerate(names):
        save_file(checkpoint(age + 1), folder / name)
        os.utime(folder / name, (1000 + age, 1000 + age))
    if corrupt:
        flip_a_tensor_byte(folder / corrupt)
    return root


def test_last_takes_this_runs_newest_intact_checkpoint_and_says_what_it_skipped(tmp_path, caplog):
    run = run_dir(tmp_path / "run", "step0000002.ckpt", "step0000004.ckpt", "last.ckpt", corrupt="last.ckpt")
    with caplog.at_level(logging.WARNING, logger="parallama"):
        found = resolve_ckpt_path("last", str(run))
    assert found == str(run / "checkpoints" / "step0000004.ckpt")
    (line,) = [r.getMessage() for r in caplog.records]
    last = run / "checkpoints" / "last.ckpt"
    assert line.startswith(
        f"ckpt_path=last: resuming {found}; skipped: checkpoint {last} is corrupt: its sha256"
    )
    assert resolve_ckpt_path(str(run), str(tmp_path / "new")) == found  # the run named by its directory
    swapping = run_dir(tmp_path / "swapping", "last.ckpt.old")  # killed while a folder checkpoint swapped in
    assert resolve_ckpt_path("last", str(swapping)) == str(swapping / "checkpoints" / "last.ckpt.old")
    message = one_error(lambda: resolve_ckpt_path(str(run / "checkpoints" / "last.ckpt"), str(run)))
    assert "last.ckpt is corrupt" in message  # named explicitly: refused


def test_last_never_takes_another_runs_checkpoint(tmp_path):
    runs = tmp_path / "logs" / "train" / "runs"
    run_dir(runs / "earlier", "last.ckpt")  # an unrelated run, newer than anything of this one
    this = runs / "killed-before-its-first-checkpoint"
    this.mkdir()
    message = one_error(lambda: resolve_ckpt_path("last", str(this)))
    assert message == (
        f"ckpt_path=last: this run's directory {this} has no checkpoint (looked for {this}/checkpoints/*.ckpt); "
        "resume another run with ckpt_path=<its run dir or a checkpoint> (or hydra.run.dir=<its run dir> "
        "ckpt_path=last), or drop ckpt_path to start afresh"
    )
    (this / "checkpoints" / "last.ckpt.partial").mkdir(parents=True)  # its first folder save was cut off
    assert "this run's only checkpoint is" in one_error(lambda: resolve_ckpt_path("last", str(this)))
    run_dir(tmp_path / "broken", "last.ckpt", corrupt="last.ckpt")
    assert "no checkpoint of this run's directory" in one_error(
        lambda: resolve_ckpt_path("last", str(tmp_path / "broken"))
    )


def test_stopped_runs_advise_only_a_resume_that_can_happen(tmp_path):
    assert last_checkpoint_note(str(tmp_path)) == (
        "no checkpoint was written yet: nothing to resume, start afresh without ckpt_path"
    )
    run_dir(tmp_path, "last.ckpt")
    last = tmp_path / "checkpoints" / "last.ckpt"
    expected = f"last checkpoint: {last}; resume with hydra.run.dir={tmp_path} ckpt_path=last"
    assert last_checkpoint_note(str(tmp_path)) == expected
    stopped = Preempted(f"stopped by SIGTERM at step 3; last checkpoint: {last}", resume_overrides(last))
    assert stopped.line.endswith(f"; resume with hydra.run.dir={tmp_path} ckpt_path=last")
    elsewhere = Preempted("stopped by SIGTERM at step 3", resume_overrides(tmp_path / "mine.ckpt"))
    assert elsewhere.line.endswith(f"; resume with ckpt_path={tmp_path / 'mine.ckpt'}")
    requeued = Preempted("stopped by SIGUSR1 at step 3; requeued SLURM job 7: it resumes from there")
    assert requeued.line == str(requeued)  # SLURM resumes it: no advice
