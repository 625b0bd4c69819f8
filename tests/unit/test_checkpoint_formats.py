"""One `detect()` for checkpoint formats, and a checkpoint's client state read once per file version."""

import os

import pytest
import torch

from parallama.checkpoint import formats, untrusted
from parallama.errors import ConfigError


def test_detect_names_each_format_and_refuses_anything_else(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "a.ckpt")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("tag")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    assert [formats.detect(tmp_path / n) for n in ("a.ckpt", "ds", "dcp")] == ["file", "deepspeed", "dcp"]
    with pytest.raises(ConfigError, match="does not exist"):
        formats.detect(tmp_path / "missing")
    with pytest.raises(ConfigError, match="is a folder but neither a DeepSpeed checkpoint"):
        formats.detect(tmp_path / "empty")


def test_client_state_is_read_once_per_file_version(tmp_path, monkeypatch):
    reads = []
    real = untrusted.load_weights_only
    monkeypatch.setattr(untrusted, "load_weights_only", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.ones(3)}, "global_step": 2, "hyper_parameters": {"x": 1}}, path)
    first = formats.client_state(path)
    assert first == {"global_step": 2, "hyper_parameters": {"x": 1}}
    first["hyper_parameters"]["x"] = 99  # callers get copies
    assert formats.client_state(path) == {"global_step": 2, "hyper_parameters": {"x": 1}}
    assert len(reads) == 1
    torch.save({"state_dict": {}, "global_step": 4}, path)  # a new checkpoint at the same path
    os.utime(path, ns=(1, 1))
    assert formats.client_state(path) == {"global_step": 4}
    assert len(reads) == 2
