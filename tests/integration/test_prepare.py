"""`parallama-prepare` and the sharded token cache: the same entry as training builds, byte for byte, whatever the
number of processes or nodes; resumable after kill -9; stale inputs get a new entry; the tokenizer's sample."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import signal
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, run_cli, start_cli, train
from hydra import compose, initialize_config_dir

from parallama import CONF_DIR
from parallama.cli.prepare import prepare
from parallama.data import PackedDataset, TextDataModule, byte_level, embedded, train_bpe
from parallama.data.cache import TokenCache, load_tokenizer
from parallama.data.parts import part_paths
from parallama.data.progress import Progress
from parallama.data.shards import ShardedTokens, ShardWriter
from parallama.errors import ConfigError

PROSE = partial(embedded)  # 79 documents, 465 K characters
SMALL = {"part_chars": 20_000, "shard_tokens": 50_000}  # many parts and shards from a small corpus


def entry_files(path) -> dict[str, bytes]:
    """Every file of an entry (parts are gone once the index is written)."""
    path = Path(path)
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def build(cache_dir, source=PROSE, tokenizer=None, **kw):
    cache = TokenCache(source, tokenizer or byte_level(), str(cache_dir), val_fraction=0.1, seed=3)
    return cache, cache.build_or_open(**{**SMALL, **kw})


def test_sharded_tokens_read_across_shards_and_pickle_as_paths(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    writer = ShardWriter(str(tmp_path), "train", np.uint16, 300)
    for piece in np.split(tokens, [7, 7, 450, 999]):  # pieces that cross shard boundaries, and empty ones
        writer.write(piece)
    names = writer.close()
    assert names == [f"train-{i:05d}.bin" for i in range(4)]
    sizes = [os.path.getsize(tmp_path / n) // 2 for n in names]
    assert sizes == [300, 300, 300, 100]
    view = ShardedTokens([str(tmp_path / n) for n in names], "uint16", sizes)
    assert len(view) == 1000 and view[299] == 299 and view[300] == 300 and view[-1] == 999
    for a, b in ((0, 1000), (295, 305), (250, 950), (600, 600), (999, 2000), (300, 600)):
        assert view[a:b].tolist() == tokens[a:b].tolist(), (a, b)
    blob = pickle.dumps(view)
    assert len(blob) < 1000  # paths, not tokens
    packed, reference = PackedDataset(pickle.loads(blob), 64), PackedDataset(tokens, 64)
    assert len(packed) == len(reference)
    assert all(torch.equal(packed[i]["input_ids"], reference[i]["input_ids"]) for i in range(len(packed)))
    assert len(ShardedTokens([], "uint16", [])) == 0 and len(ShardedTokens([], "uint16", [])[0:5]) == 0


def test_two_processes_write_what_one_writes_byte_for_byte(tmp_path):
    one_cache, one = build(tmp_path / "one", num_proc=1)
    two_cache, two = build(tmp_path / "two", num_proc=2)
    assert one_cache.name == two_cache.name  # num_proc is not part of the key
    assert len(one.index["splits"]["train"]["shards"]) > 2  # several shards, cut inside documents
    files_one = entry_files(one.path)
    assert files_one == entry_files(two.path)
    assert sorted(files_one) == sorted(
        [*(s["file"] for split in ("train", "val") for s in one.index["splits"][split]["shards"])]
        + ["index.json", "tokenizer.json", "train.idx.npy", "val.idx.npy"]
    )
    # the documents are those the tokenizer gives, each once, split by document
    tok = byte_level()
    docs = []
    for split in ("train", "val"):
        tokens, offsets = one.tokens(split), one.doc_offsets(split)
        docs += [tuple(tokens[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
    assert sorted(docs) == sorted(tuple([256, *tok.encode(d).ids, 257]) for d in PROSE())
    assert one.n_docs == {"train": 71, "val": 8}


def test_nodes_share_the_parts_and_node_0_writes_the_same_index(tmp_path, caplog):
    _, single = build(tmp_path / "single")
    cache = TokenCache(PROSE, byte_level(), str(tmp_path / "nodes"), val_fraction=0.1, seed=3)
    assert cache.build_or_open(num_nodes=2, node_rank=0, step="parts", **SMALL) is None
    with pytest.raises(ConfigError) as e:  # node 1 has not run: its parts are missing
        cache.build_or_open(num_nodes=2, step="index", **SMALL)
    message = str(e.value)
    assert "\n" not in message and "parts are missing" in message and "prepare.node_rank=1 " in message
    caplog.set_level(logging.INFO, logger="parallama")
    assert cache.build_or_open(num_nodes=2, node_rank=1, **SMALL) is None  # its share, then exits
    assert "of node 1 (0 of them done by an earlier run" in caplog.text
    entry = cache.build_or_open(num_nodes=2, node_rank=0, **SMALL)  # its parts exist: straight to the index
    assert entry_files(entry.path) == entry_files(single.path)


def test_a_truncated_part_is_made_again(tmp_path, caplog):
    cache, reference = build(tmp_path / "reference")
    broken = TokenCache(PROSE, byte_level(), str(tmp_path / "broken"), val_fraction=0.1, seed=3)
    broken.build_or_open(step="parts", **SMALL)
    folder = Path(broken.path) / f"parts-{SMALL['part_chars']}"
    bin_path, docs_path = part_paths(str(folder), 2)
    os.truncate(bin_path, os.path.getsize(bin_path) // 2)  # as a crash of the machine could leave it
    Path(part_paths(str(folder), 3)[1]).write_bytes(b"\x93NUMPY")  # a truncated .npy
    caplog.set_level(logging.INFO, logger="parallama")
    entry = broken.build_or_open(**SMALL)
    assert "part-000002.bin has" in caplog.text and "part-000003.docs.npy is unreadable" in caplog.text
    n_parts, reused = parts_line(caplog.text)
    assert reused == n_parts - 2  # all others reused, these two made again
    assert entry_files(entry.path) == entry_files(reference.path)


def test_an_entry_of_the_one_file_layout_is_upgraded_in_place(tmp_path):
    """Caches written before shards (train.bin, val.bin, meta.json) keep their name (resumes check it) and are
    opened without tokenizing again."""
    cache, built = build(tmp_path, shard_tokens=10**9)
    path = Path(built.path)
    for split in ("train", "val"):
        (path / f"{split}-00000.bin").rename(path / f"{split}.bin")
    meta = {k: built.index[k] for k in ("n_docs", "n_tokens", "dtype", "vocab_size")}
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "index.json").unlink()
    reopened = TokenCache(PROSE, byte_level(), str(tmp_path), val_fraction=0.1, seed=3).open()
    assert reopened is not None and reopened.name == cache.name
    assert sorted(os.listdir(path)) == sorted(entry_files(built.path)) and not (path / "meta.json").exists()
    for split in ("train", "val"):
        assert reopened.tokens(split)[:].tolist() == built.tokens(split)[:].tolist()
        assert reopened.doc_offsets(split).tolist() == built.doc_offsets(split).tolist()


def test_a_changed_input_file_gets_a_new_entry_that_training_reads(tmp_path, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the old text of a")
    (corpus / "b.txt").write_text("b stays the same")
    overrides = [
        "data/source=files",
        f"data.source.paths={corpus}/*.txt",
        f"paths.cache_dir={tmp_path / 'c'}",
    ]
    (old,) = compose_and_prepare(overrides)
    stamp = os.stat(corpus / "a.txt").st_mtime_ns
    (corpus / "a.txt").write_text("the NEW text of a")  # same name and size
    os.utime(corpus / "a.txt", ns=(stamp + 10**9, stamp + 10**9))
    (new,) = compose_and_prepare(overrides)
    assert new.path != old.path and os.path.exists(old.path)

    caplog.set_level(logging.INFO, logger="parallama")
    dm = datamodule(overrides)  # what parallama-train builds from the same overrides
    dm.setup()
    assert dm.data_dir == new.path and "building token cache" not in caplog.text
    text = "".join(dm.tokenizer.decode(dm.datasets[split].tokens[:].tolist()) for split in ("train", "val"))
    assert "the NEW text of a" in text and "old" not in text


def compose_and_prepare(overrides: list[str]):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return prepare(compose("prepare", overrides=["prepare.num_proc=1", *overrides]))


def datamodule(overrides: list[str]) -> TextDataModule:
    import hydra

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    return hydra.utils.instantiate(cfg.data, batch_size=1, seq_len=4)


def test_prepare_builds_the_entry_training_would_build(tmp_path, caplog):
    """In-process (the CLI cases are below): the same overrides give training the prepared entry, whose files
    are those training writes when it builds the entry itself."""
    overrides = ["tokenizer=bpe", "tokenizer.vocab_size=300", "data.source.max_documents=20"]
    (prepared,) = compose_and_prepare([*overrides, f"paths.cache_dir={tmp_path / 'a'}"])
    caplog.set_level(logging.INFO, logger="parallama")
    reuses = datamodule([*overrides, f"paths.cache_dir={tmp_path / 'a'}"])
    reuses.prepare_data()
    assert f"reusing token cache {prepared.path}" in caplog.text
    builds = datamodule([*overrides, f"paths.cache_dir={tmp_path / 'b'}"])
    builds.prepare_data()
    assert "in this process; for big corpora build it ahead" in caplog.text  # the hint, once
    assert os.path.basename(builds.data_dir) == prepared.name
    assert entry_files(builds.data_dir) == entry_files(prepared.path)
    tokenizers = [p.read_bytes() for d in "ab" for p in (tmp_path / d).glob("tokenizer-*.json")]
    assert len(tokenizers) == 2 and tokenizers[0] == tokenizers[1]


def test_a_mixture_is_prepared_source_by_source_with_the_mixtures_tokenizer(tmp_path, caplog):
    overrides = [
        "experiment=mixture",
        "tokenizer=bpe",
        "tokenizer.vocab_size=300",
        f"paths.cache_dir={tmp_path}",
    ]
    overrides += ["data.sources.code.source.max_documents=5", "data.sources.prose.source.max_documents=8"]
    prepared = compose_and_prepare(overrides)
    caplog.set_level(logging.INFO, logger="parallama")
    dm = datamodule(overrides)
    dm.prepare_data()
    assert "building token cache" not in caplog.text and "training tokenizer" not in caplog.text
    assert sorted(part.data_dir for part in dm.parts.values()) == sorted(entry.path for entry in prepared)
    assert len(list(tmp_path.glob("tokenizer-*.json"))) == 1


def test_train_documents_caps_the_tokenizer_sample(tmp_path):
    docs = list(embedded(max_documents=30))
    capped = train_bpe(docs, vocab_size=300, train_documents=10)
    assert capped.to_str() == train_bpe(docs[:10], vocab_size=300).to_str()
    assert capped.to_str() != train_bpe(docs, vocab_size=300).to_str()
    assert train_bpe(docs, vocab_size=300, train_documents=1000).to_str() == train_bpe(docs, 300).to_str()
    source = partial(embedded, max_documents=30)
    paths = {
        load_tokenizer(source, partial(train_bpe, vocab_size=300, train_documents=n), str(tmp_path)).to_str()
        for n in (10, 1000)
    }
    assert len(paths) == 2 and len(list(tmp_path.glob("tokenizer-*.json"))) == 2  # the cap is in the key


def test_progress_gives_the_share_done_and_an_eta(caplog):
    caplog.set_level(logging.INFO, logger="parallama")
    with Progress("tokenizing", every=0, total=10) as progress:
        progress.reused(4)
        progress.update(2, 100)
    line = caplog.records[1].getMessage()
    assert line.startswith("tokenizing: 2 docs, 100 tokens so far (") and ", 60%, ETA 0:00:" in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["prepare.num_proc=0"], "prepare.num_proc=0 is not valid; use an integer >= 1 or null"),
        (
            ["prepare.num_nodes=2", "prepare.node_rank=2"],
            "prepare.node_rank=2 is not below prepare.num_nodes=2; use 0..1",
        ),
        (
            ["prepare.num_procs=2"],
            "unknown config key 'prepare.num_procs' (did you mean 'prepare.num_proc'?); "
            "to add a new key write +prepare.num_procs=...",
        ),
    ],
)
def test_bad_prepare_values_are_one_error_line(tmp_path, args, message):
    proc = run_cli("parallama.cli.prepare", *args, f"paths.cache_dir={tmp_path}", cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and errors == [f"error: {message}"], out[-2000:]
    assert list(tmp_path.iterdir()) == []  # stopped before any work


def test_kill_9_during_prepare_then_rerun_completes_with_identical_shards(tmp_path):
    """A prepare killed with SIGKILL (all its processes, as a lost node) keeps its finished parts; the rerun
    does only the rest and writes what an uninterrupted build writes."""
    args = ["data.source.corpus=code", "data.source.max_documents=60", "prepare.num_proc=2"]
    args += ["prepare.part_chars=20000", "prepare.shard_tokens=300000", f"paths.cache_dir={tmp_path / 'c'}"]
    proc = start_cli("parallama.cli.prepare", *args, cwd=tmp_path)  # its own process group, workers too
    try:
        deadline = time.monotonic() + 120
        while len(done := list((tmp_path / "c").glob("*/parts-*/*.docs.npy"))) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "prepare ended before the kill"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    assert not list((tmp_path / "c").glob("*/index.json"))  # killed mid-way
    rerun = run_cli("parallama.cli.prepare", *args, cwd=tmp_path)
    n_parts, reused = parts_line(rerun.stdout + rerun.stderr)
    assert len(done) <= reused < n_parts  # what was finished is kept, the rest is done now
    reference = TokenCache(
        partial(embedded, corpus="code", max_documents=60), byte_level(), str(tmp_path / "ref"), 0.05, 42
    ).build_or_open(part_chars=20_000, shard_tokens=300_000)
    (index,) = (tmp_path / "c").glob("*/index.json")
    assert index.parent.name == reference.name
    assert entry_files(index.parent) == entry_files(reference.path)


def parts_line(text: str) -> tuple[int, int]:
    """(parts, parts reused) from the log line `N parts (M of them done by an earlier run and reused)`."""
    match = re.search(r"(\d+) parts(?:, \d+ of node \d+)? \((\d+) of them done by an earlier run", text)
    assert match, text[-3000:]
    return int(match.group(1)), int(match.group(2))


@pytest.mark.slow  # two training runs: ~40 s
def test_prepare_then_train_equals_train_building_the_cache(tmp_path):
    """The CLIs end to end: a run on a prepared cache trains exactly what a run that builds the cache trains."""
    run_cli("parallama.cli.prepare", *TINY, f"paths.cache_dir={tmp_path / 'a'}", cwd=tmp_path)
    prepared = train(cwd=tmp_path, cache=tmp_path / "a", run_dir=tmp_path / "run_a")
    assert "building token cache" not in prepared.stdout + prepared.stderr
    built = train(cwd=tmp_path, cache=tmp_path / "b", run_dir=tmp_path / "run_b")
    assert "build it ahead, in parallel and resumable: parallama-prepare" in built.stdout + built.stderr
    (a,), (b,) = (tmp_path / "a").glob("*/index.json"), (tmp_path / "b").glob("*/index.json")
    assert a.parent.name == b.parent.name and entry_files(a.parent) == entry_files(b.parent)
    weights = [
        torch.load(tmp_path / run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)[
            "state_dict"
        ]
        for run in ("run_a", "run_b")
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
