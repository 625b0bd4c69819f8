"""Data pipeline tests: tokenizers, sources, caching, packing/padding, sampling. Bad input: test_bad_data.py."""

import itertools
import json
import logging
import os
import pickle
import random
import stat
import sys
from functools import partial
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch.utils.data import DistributedSampler

from parallama.data import (
    BOT,
    EOT,
    PAD,
    PackedDataset,
    PaddedDataset,
    ResumableDistributedSampler,
    TextDataModule,
    byte_level,
    embedded,
    files,
    from_pretrained,
    hub,
    special_ids,
    train_bpe,
)
from parallama.data.cache import CacheEntry
from parallama.data.datamodule import _source_key
from parallama.data.progress import Progress
from parallama.tokenizer import CHUNK_CHARS, SPECIALS, UNK, chunks, splits_safely

TRICKY = [
    "",
    "hello world",
    "  leading spaces and trailing  ",
    "\n\nnewlines\r\n\ttabs\n",
    "héllo wörld — ünïcödé",
    "emoji 😀👍🏽 and 日本語 and עברית",
    "zero\u200bwidth and \x00 nul",
    "literal [bot] brackets",
]


def _one_line_error(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


@pytest.fixture(scope="module")
def prose():
    return list(embedded(max_documents=12))


@pytest.fixture(scope="module")
def bpe(prose):
    return train_bpe(prose, vocab_size=400)


# --- tokenizers -------------------------------------------------------------


def test_byte_level_round_trip_and_specials():
    tok = byte_level()
    assert tok.get_vocab_size() == 260
    for text in TRICKY:
        ids = tok.encode(text).ids
        assert max(ids, default=0) < 256
        assert tok.decode(ids) == text
    ids = special_ids(tok)
    assert ids == (256, 257, 258)
    assert tok.encode(f"{BOT}hi{EOT}{PAD}").ids == [ids.bot, *tok.encode("hi").ids, ids.eot, ids.pad]
    assert tok.decode([ids.bot, *tok.encode("hi").ids, ids.eot], skip_special_tokens=False) == f"{BOT}hi{EOT}"
    assert tok.decode([ids.bot, *tok.encode("hi").ids, ids.eot]) == "hi"


def test_train_bpe_round_trip_size_and_determinism(prose, bpe):
    assert bpe.get_vocab_size() == 400
    assert special_ids(bpe) == (0, 1, 2)
    for text in TRICKY + prose[:3]:
        assert bpe.decode(bpe.encode(text).ids) == text
    assert len(bpe.encode(prose[0]).ids) < len(prose[0].encode())  # merges compress
    assert train_bpe(prose, vocab_size=400).to_str() == bpe.to_str()
    with pytest.raises(ValueError) as e:
        train_bpe(prose, vocab_size=100)
    _one_line_error(e, "tokenizer.vocab_size")


def test_from_pretrained_file_folder_and_missing(tmp_path, bpe):
    bpe.save(str(tmp_path / "tokenizer.json"))
    for where in (tmp_path / "tokenizer.json", tmp_path):
        tok = from_pretrained(str(where))
        assert tok.to_str() == bpe.to_str()
    for missing in (tmp_path / "nope.json", tmp_path / "nope" / "dir", "./nothing-here"):
        with pytest.raises(FileNotFoundError) as e:
            from_pretrained(str(missing))
        _one_line_error(e, str(missing).lstrip("./"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        from_pretrained(str(tmp_path / "empty"))
    _one_line_error(e, str(tmp_path / "empty"))


def test_from_pretrained_maps_existing_bos_eos_and_adds_pad(tmp_path):
    tok = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[])
    )
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = from_pretrained(str(tmp_path / "tokenizer.json"))
    assert loaded.get_vocab_size() == 259
    assert special_ids(loaded) == (256, 257, 258)
    assert loaded.token_to_id(PAD) == 258 and loaded.token_to_id(BOT) is None


def test_chunked_encoding_equals_whole_encoding(bpe):
    """Cuts fall only where GPT-2 style pre-tokenizers cut, so the ids never change, at any chunk size."""
    rng = random.Random(0)
    alphabet = [
        *"ab c\n\t\r  '!.,1234 xyz",
        "é",
        "日",
        "😀",
        "\u00a0",
        "\u3000",
        "\x1c",
        BOT,
        " 's",
        "'ll",
        "\x00",
    ]
    texts = TRICKY + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))) for _ in range(60)]
    for tok in (byte_level(), bpe):
        assert splits_safely(tok)
        for text in texts:
            whole = tok.encode(text, add_special_tokens=False).ids
            for size in (1, 2, 5, 40):
                pieces = list(chunks(text, size))
                assert "".join(pieces) == text
                assert [i for p in pieces for i in tok.encode(p, add_special_tokens=False).ids] == whole
    long = "x" * 100 + " y" * 100
    assert [len(p) for p in chunks(long, 151)] == [152, 148]  # cut at the first safe place past `size`
    assert list(chunks("x" * 500, 10)) == ["x" * 500]  # nowhere safe to cut: whole


def test_splits_safely_only_for_gpt2_style_pipelines(bpe):
    lowercasing = Tokenizer.from_str(bpe.to_str())
    lowercasing.normalizer = normalizers.Lowercase()
    metaspace = Tokenizer(models.BPE(unk_token="[UNK]"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    prefix = Tokenizer.from_str(bpe.to_str())
    prefix.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not any(map(splits_safely, (lowercasing, metaspace, prefix)))


def test_a_bpe_vocabulary_smaller_than_asked_is_one_line(caplog, monkeypatch):
    """Found: a small corpus gave 560 tokens for the 4096 asked, silently."""
    import logging

    monkeypatch.setattr(logging.getLogger("parallama"), "disabled", False)  # an in-process Hydra app may have
    tok = train_bpe(["the cat sat on the mat"] * 3, vocab_size=4096)
    (line,) = [r.getMessage() for r in caplog.records if "BPE learned" in r.getMessage()]
    assert line.startswith(
        f"tokenizer: BPE learned {tok.get_vocab_size()} tokens, not the tokenizer.vocab_size=4096"
    )
    assert "min_frequency=2" in line and "\n" not in line


def test_train_bpe_on_chunks_equals_whole_documents():
    """train_bpe feeds long texts in chunks: the same word counts, so the same tokenizer as unchunked."""
    long = "\n".join(embedded())
    assert len(long) > 2 * CHUNK_CHARS
    reference = Tokenizer(models.BPE(unk_token=UNK))
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    reference.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    reference.train_from_iterator([long], trainer=trainer)
    assert train_bpe([long], vocab_size=400).to_str() == reference.to_str()


# --- sources ----------------------------------------------------------------


def test_embedded_corpora():
    docs = list(embedded())
    assert len(docs) == 79 and all(isinstance(d, str) and d for d in docs)
    assert docs == list(embedded())
    assert list(embedded(max_documents=5)) == docs[:5]
    code = list(embedded("code", max_documents=3))
    assert len(code) == 3 and code == list(embedded("code", max_documents=3))
    with pytest.raises(ValueError) as e:
        embedded("poetry")
    _one_line_error(e, "data.source.corpus", "prose", "code")


def test_files_txt_jsonl_parquet_and_glob(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nsecond line\n")
    (tmp_path / "b.txt").write_text("  other\n\ndoc")
    (tmp_path / "n.md").write_text("# title\n")
    (tmp_path / "c.jsonl").write_text(
        "\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate("xyz"))
    )
    datasets.Dataset.from_dict({"text": ["p1", "p2"], "n": [1, 2]}).to_parquet(str(tmp_path / "d.parquet"))

    assert list(files(str(tmp_path / "*.txt"))) == ["first doc\nsecond line\n", "  other\n\ndoc"]
    assert list(files(str(tmp_path / "c.jsonl"), text_key="body")) == ["x", "y", "z"]
    assert list(files(str(tmp_path / "d.parquet"))) == ["p1", "p2"]
    mixed = files([str(tmp_path / "n.md"), str(tmp_path / "*.parquet"), str(tmp_path / "a.txt")])
    assert list(mixed) == ["# title\n", "p1", "p2", "first doc\nsecond line\n"]
    assert list(files(str(tmp_path / "c.jsonl"), text_key="body", max_documents=2)) == ["x", "y"]


def test_files_errors(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "bad.parquet").write_bytes(b"garbage, not parquet")
    (tmp_path / "data.csv").write_text("text\nx\n")

    with pytest.raises(FileNotFoundError) as e:
        files(str(tmp_path / "*.txt"))
    _one_line_error(e, "data.source.paths", "*.txt", "matches no file")
    with pytest.raises(ValueError) as e:
        files([])
    _one_line_error(e, "data.source.paths", "empty")
    with pytest.raises(ValueError) as e:
        files(str(tmp_path / "data.csv"))
    _one_line_error(e, "data.csv", ".txt", ".jsonl", ".parquet")
    with pytest.raises(ValueError) as e:
        list(files(str(tmp_path / "c.jsonl")))
    _one_line_error(e, "data.source.text_key", "c.jsonl", "body")
    for bad in ("bad.jsonl", "bad.parquet"):
        with pytest.raises(ValueError) as e:
            list(files(str(tmp_path / bad)))
        _one_line_error(e, "data.source.paths", bad)


@pytest.mark.parametrize("streaming", [True, False])
def test_hub_on_local_folder(tmp_path, monkeypatch, streaming):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, texts in (("part0.jsonl", ["a", "b"]), ("part1.jsonl", ["c"])):
        (folder / name).write_text("\n".join(json.dumps({"text": t, "url": "u"}) for t in texts))
    assert list(hub(str(folder), streaming=streaming)) == ["a", "b", "c"]
    assert list(hub(str(folder), streaming=streaming, max_documents=2)) == ["a", "b"]
    if not streaming:  # streaming only learns the columns while iterating
        with pytest.raises(ValueError) as e:
            hub(str(folder), streaming=False, text_key="content")
        _one_line_error(e, "data.source.text_key", "url")


# --- datasets and sampler ---------------------------------------------------


def test_packed_dataset_is_exact():
    tokens = np.arange(1000, dtype=np.uint16)
    for seq_len in (1, 7, 64, 999):
        ds = PackedDataset(tokens, seq_len)
        assert len(ds) == (len(tokens) - 1) // seq_len
        items = [ds[i] for i in range(len(ds))]
        inputs = torch.cat([it["input_ids"] for it in items])
        assert inputs.dtype == torch.int64
        assert inputs.tolist() == tokens[: len(ds) * seq_len].tolist()  # nothing lost or duplicated
        for i, it in enumerate(items):
            assert int(it["index"]) == i  # what the data module checks each train batch against
            assert it["labels"][:-1].tolist() == it["input_ids"][1:].tolist()
            assert it["labels"][-1] == it["input_ids"][-1] + 1
    assert len(PackedDataset(tokens, 1000)) == 0
    with pytest.raises(IndexError):
        PackedDataset(tokens, 7)[len(PackedDataset(tokens, 7))]


def test_padded_dataset_truncates_and_pads():
    pad = 99
    docs = [[1, 10, 11, 2], [1, 20, 21, 22, 23, 24, 25, 2], [1, 2]]
    tokens = np.array(sum(docs, []), dtype=np.uint16)
    offsets = np.cumsum([0] + [len(d) for d in docs])
    ds = PaddedDataset(tokens, offsets, seq_len=5, pad_id=pad)
    assert len(ds) == 3
    short, long, empty = ds[0], ds[1], ds[2]
    assert short["input_ids"].tolist() == [1, 10, 11, 2, pad]
    assert short["labels"].tolist() == [10, 11, 2, -100, -100]
    assert short["attention_mask"].tolist() == [1, 1, 1, 1, 0]
    assert long["input_ids"].tolist() == [1, 20, 21, 22, 23]
    assert long["labels"].tolist() == [20, 21, 22, 23, 24]
    assert long["attention_mask"].tolist() == [1] * 5
    assert empty["labels"].tolist() == [2, -100, -100, -100, -100]
    assert empty["attention_mask"].tolist() == [1, 1, 0, 0, 0]
    assert [int(it["index"]) for it in (short, long, empty)] == [0, 1, 2]
    assert all(v.dtype == torch.int64 and v.shape == (5,) for k, v in short.items() if k != "index")


def test_memmap_datasets_pickle_as_path(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(10_000, dtype=np.uint16).tofile(path)
    ds = PackedDataset(np.memmap(path, dtype=np.uint16, mode="r"), 8)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # not the 20 KB of tokens
    assert pickle.loads(blob)[3]["input_ids"].tolist() == list(range(24, 32))


def _epoch(n, world, rank, epoch=0):
    sampler = ResumableDistributedSampler(range(n), num_replicas=world, rank=rank, seed=3)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("n", [10, 11, 37])
def test_sampler_ranks_partition_the_single_process_epoch(n):
    single = _epoch(n, 1, 0)
    assert sorted(single) == list(range(n))
    for world in (2, 3):
        per_rank = [_epoch(n, world, r) for r in range(world)]
        sets = [set(p) for p in per_rank]
        assert all(len(p) == n // world for p in per_rank)
        assert all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])
        assert set().union(*sets) == set(single[: world * (n // world)])
    b = 2  # 1 process x batch 2b == union of 2 ranks x batch b
    assert set(_epoch(n, 2, 0)[:b]) | set(_epoch(n, 2, 1)[:b]) == set(single[: 2 * b])


def _train(n, segments, seed=3):
    """Train `segments` of (world size, per-rank batch, steps) one after another, each resuming at the global
    position where the previous one stopped, as the data module does. Returns {epoch: sample indices trained}."""
    trained, epoch, position = {}, 0, 0
    for world, batch, steps in segments:
        size = world * batch
        samplers = [ResumableDistributedSampler(range(n), world, rank, seed=seed) for rank in range(world)]
        for sampler in samplers:
            sampler.start_at(epoch, position)
            assert len(sampler) == n // world  # the full epoch: Lightning's count of batches
        ranks = [iter(sampler) for sampler in samplers]
        for _ in range(steps):
            if n - position < size:  # no full global batch left: the loader starts the next epoch
                epoch, position = epoch + 1, 0
                for sampler in samplers:
                    sampler.set_epoch(epoch)
                ranks = [iter(sampler) for sampler in samplers]
            shares = [list(itertools.islice(rank, batch)) for rank in ranks]
            assert all(len(share) == batch for share in shares)
            trained.setdefault(epoch, []).extend(i for share in shares for i in share)
            position += size
    return trained


@pytest.mark.parametrize("before, after", [((2, 3), (1, 6)), ((1, 6), (2, 3)), ((2, 3), (3, 2))])
def test_resume_at_another_world_size_trains_what_an_uninterrupted_run_does(before, after):
    """Same global batch: the samples of every epoch (the second is entered after the resume) are those of a
    run at the new size from the start, each once."""
    resumed = _train(37, [(*before, 4), (*after, 6)])
    straight = _train(37, [(*after, 10)])
    assert resumed.keys() == straight.keys() == {0, 1}
    for epoch, samples in resumed.items():
        assert len(set(samples)) == len(samples) and sorted(samples) == sorted(straight[epoch])


def test_resume_with_another_global_batch_continues_at_the_same_sample():
    """4 samples per step, then 6: each epoch trains a prefix of its order, each sample once; only a tail
    shorter than one global batch is left out, as in any epoch."""
    resumed = _train(37, [(2, 2, 4), (3, 2, 8)])
    assert {e: len(s) for e, s in resumed.items()} == {0: 16 + 3 * 6, 1: 5 * 6}
    sampler = ResumableDistributedSampler(range(37), seed=3)
    for epoch, samples in resumed.items():
        assert len(set(samples)) == len(samples)
        assert sorted(samples) == sorted(sampler.order(epoch)[: len(samples)].tolist())
    assert sampler.order(0).tolist() != sampler.order(1).tolist()  # a new epoch reshuffles (seed + epoch)


def test_sampler_order_is_distributed_samplers():
    """The same order as before positions were global, so older checkpoints continue their epoch exactly."""
    for world in (1, 2, 3):
        for rank in range(world):
            old = DistributedSampler(range(50), world, rank, shuffle=True, seed=7, drop_last=True)
            new = ResumableDistributedSampler(range(50), world, rank, seed=7)
            for epoch in (0, 1):
                old.set_epoch(epoch)
                new.set_epoch(epoch)
                assert list(new) == list(old)


# --- datamodule -------------------------------------------------------------


def _dm(tmp_path, tokenizer=byte_level, **kw):
    kw = {"seq_len": 32, "batch_size": 4, "cache_dir": str(tmp_path / "cache"), **kw}
    return TextDataModule(source=partial(embedded, max_documents=10), tokenizer=partial(tokenizer), **kw)


def _split_docs(dm, split):
    entry = CacheEntry(dm.data_dir)
    tokens, offsets = entry.tokens(split)[:], entry.doc_offsets(split)
    assert offsets.dtype == np.int64 and offsets[0] == 0 and offsets[-1] == len(tokens)
    return [tuple(tokens[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def test_cache_holds_each_document_once_and_is_reused(tmp_path):
    dm = _dm(tmp_path, val_fraction=0.2)
    dm.prepare_data()
    tok, ids = dm.tokenizer, dm.special_ids
    expected = sorted(tuple([ids.bot, *tok.encode(d).ids, ids.eot]) for d in embedded(max_documents=10))
    train, val = _split_docs(dm, "train"), _split_docs(dm, "val")
    assert len(val) == 2 and len(train) == 8
    assert sorted(train + val) == expected  # disjoint and covering
    meta = json.loads(open(os.path.join(dm.data_dir, "index.json")).read())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 260
    assert meta["n_docs"] == {"train": 8, "val": 2}
    assert meta["n_tokens"]["train"] == sum(map(len, train))
    assert Tokenizer.from_file(os.path.join(dm.data_dir, "tokenizer.json")).to_str() == tok.to_str()

    mtime = os.path.getmtime(os.path.join(dm.data_dir, "train-00000.bin"))
    again = _dm(tmp_path, val_fraction=0.2, seq_len=64, packing=False)
    assert again.data_dir == dm.data_dir
    again.prepare_data()
    assert os.path.getmtime(os.path.join(dm.data_dir, "train-00000.bin")) == mtime
    assert _dm(tmp_path, val_fraction=0.2, seed=1).data_dir != dm.data_dir
    assert [p for p in os.listdir(tmp_path / "cache") if p.startswith(".")] == []  # no tmp left


@pytest.mark.parametrize("tokenizer", [byte_level, partial(train_bpe, vocab_size=350)])
@pytest.mark.parametrize("packing", [True, False])
def test_datamodule_end_to_end(tmp_path, tokenizer, packing):
    dm = _dm(tmp_path, tokenizer=tokenizer, packing=packing)
    dm.setup("fit")  # no Trainer: builds the cache itself
    batch = next(iter(dm.train_dataloader()))
    keys = {"input_ids", "labels", "index"} | ({"attention_mask"} if not packing else set())
    assert set(batch) == keys
    assert batch.pop("index").shape == (4,)
    assert all(v.shape == (4, 32) and v.dtype == torch.int64 for v in batch.values())
    assert int(batch["input_ids"].max()) < dm.vocab_size
    assert len(dm.val_dataloader()) >= 1
    assert isinstance(dm.train_dataloader().sampler, ResumableDistributedSampler)
    if tokenizer is not byte_level:
        assert dm.vocab_size == 350
        cached = [p for p in os.listdir(tmp_path / "cache") if p.startswith("tokenizer-")]
        assert len(cached) == 1  # trained once, then reloaded
        assert _dm(tmp_path, tokenizer=tokenizer).tokenizer.to_str() == dm.tokenizer.to_str()


def test_datamodule_errors(tmp_path):
    for key, kw in (
        ("data.seq_len", {"seq_len": 0}),
        ("data.batch_size", {"batch_size": 0}),
        ("data.val_fraction", {"val_fraction": 1.0}),
    ):
        with pytest.raises(ValueError) as e:
            _dm(tmp_path, **kw)
        _one_line_error(e, key)
    with pytest.raises(ValueError) as e:
        _dm(tmp_path, seq_len=10**6).setup("fit")
    _one_line_error(e, "data.seq_len", "tokens")


def _files_dm(tmp_path, paths, tokenizer=byte_level, **kw):
    kw = {"seq_len": 8, "batch_size": 1, "val_fraction": 0.0, "cache_dir": str(tmp_path / "cache"), **kw}
    return TextDataModule(source=partial(files, paths=paths), tokenizer=partial(tokenizer), **kw)


def _all_docs(dm):
    return sorted(_split_docs(dm, "train") + (_split_docs(dm, "val") if dm.val_fraction else []))


@pytest.mark.parametrize("tokenizer", [byte_level, partial(train_bpe, vocab_size=300)])
def test_editing_a_file_in_place_builds_a_new_cache_entry(tmp_path, caplog, tokenizer):
    (tmp_path / "a.txt").write_text("the old text of a")
    (tmp_path / "b.txt").write_text("b stays the same")
    pattern = str(tmp_path / "*.txt")
    caplog.set_level(logging.INFO, logger="parallama")
    old = _files_dm(tmp_path, pattern, tokenizer)
    old.prepare_data()
    assert f"building token cache {old.data_dir}" in caplog.text
    assert _files_dm(tmp_path, pattern, tokenizer).data_dir == old.data_dir  # identical inputs, same entry
    caplog.clear()
    _files_dm(tmp_path, pattern, tokenizer).prepare_data()
    n_tokens = sum(map(len, _all_docs(old)))
    assert f"reusing token cache {old.data_dir}: 2 docs, {n_tokens:,} tokens" in caplog.text

    stamp = os.stat(tmp_path / "a.txt").st_mtime_ns
    (tmp_path / "a.txt").write_text("the NEW text of a")  # same name and size
    os.utime(tmp_path / "a.txt", ns=(stamp + 10**9, stamp + 10**9))
    new = _files_dm(tmp_path, pattern, tokenizer)
    assert new.data_dir != old.data_dir
    new.prepare_data()
    tok, ids = new.tokenizer, new.special_ids
    expected = sorted(
        tuple([ids.bot, *tok.encode(t).ids, ids.eot]) for t in ("the NEW text of a", "b stays the same")
    )
    assert _all_docs(new) == expected
    assert os.path.isdir(old.data_dir)  # the old entry is left alone
    if tokenizer is not byte_level:  # the trained tokenizer is keyed on the files too
        assert len([p for p in os.listdir(tmp_path / "cache") if p.startswith("tokenizer-")]) == 2


def test_source_keys_cover_what_the_documents_depend_on(tmp_path):
    assert _source_key(partial(embedded, max_documents=3))[1] == [sys.version]
    (tmp_path / "a.txt").write_text("a")
    st = os.stat(tmp_path / "a.txt")
    assert _source_key(partial(files, paths=str(tmp_path / "*.txt")))[1] == [
        [str(tmp_path / "a.txt"), st.st_size, st.st_mtime_ns]
    ]
    assert _source_key(partial(hub, name="org/set"))[1] is None  # the Hub: its config only


@pytest.mark.parametrize("tokenizer", [byte_level, partial(train_bpe, vocab_size=300)])
def test_long_documents_are_tokenized_in_chunks_to_the_same_ids(tmp_path, tokenizer):
    long = "\n\n".join(embedded())  # ~465 KB: several chunks and encode batches
    assert len(long) > 4 * CHUNK_CHARS
    (tmp_path / "long.txt").write_text(long)
    (tmp_path / "short.txt").write_text("a short one")
    dm = _files_dm(tmp_path, str(tmp_path / "*.txt"), tokenizer)
    dm.prepare_data()
    tok, ids = dm.tokenizer, dm.special_ids
    expected = sorted(tuple([ids.bot, *tok.encode(t).ids, ids.eot]) for t in (long, "a short one"))
    assert _all_docs(dm) == expected


def test_progress_logs_lines_and_a_summary_when_not_a_terminal(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="parallama")
    with Progress("tokenizing", every=0) as progress:
        progress.update(2, 100)
        assert list(progress.counted(["abc", "de"])) == ["abc", "de"]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("tokenizing: 2 docs, 100 tokens so far")
    assert lines[-1].startswith("tokenizing: 4 docs, 105 tokens in ") and lines[-1].endswith(" tokens/s)")
    caplog.clear()
    dm = _dm(tmp_path, tokenizer=partial(train_bpe, vocab_size=300))
    dm.prepare_data()
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().endswith("/s)")]
    assert [m.split(":")[0] for m in summaries] == ["training tokenizer", "tokenizing"]
    assert summaries[1].startswith(
        f"tokenizing: 10 docs, {dm._meta()['n_tokens']['train'] + dm._meta()['n_tokens']['val']:,} tokens"
    )


def test_progress_shows_a_rich_line_on_a_terminal(monkeypatch, caplog):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    caplog.set_level(logging.INFO, logger="parallama")
    with Progress("tokenizing", every=0) as progress:
        assert progress._bar is not None
        progress.update(1, 7)
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["tokenizing: 1 docs, 7 tokens"]


def test_cache_files_follow_the_umask(tmp_path):
    """A team shares one cache: modes come from the umask, not mkstemp's 0600."""
    (tmp_path / "a.txt").write_text("a document")
    old = os.umask(0o022)
    try:
        for umask in (0o022, 0o002):
            os.umask(umask)
            cache = tmp_path / f"cache-{umask:o}"
            dm = _files_dm(
                tmp_path, str(tmp_path / "a.txt"), partial(train_bpe, vocab_size=300), cache_dir=str(cache)
            )
            dm.prepare_data()
            paths = [cache, *cache.glob("tokenizer-*.json"), Path(dm.data_dir), *cache.glob("*/*")]
            assert len(paths) == 8  # the cache, a tokenizer, the entry and its 5 files (no val shard)
            for path in paths:
                want = (0o777 if path.is_dir() else 0o666) & ~umask
                assert stat.S_IMODE(path.stat().st_mode) == want, (path, oct(path.stat().st_mode))
    finally:
        os.umask(old)
