"""Weighted data mixtures (`data.sources`): proportions, repetition and subsampling, determinism, cache entries
per source, the resumed sampler, and the one-line errors of bad mixtures (through the CLI: tests/integration)."""

from __future__ import annotations

import logging
import re
from functools import partial

import numpy as np
import pytest
import torch

from parallama.data import EpochIndexSampler, MixtureDataset, PackedDataset, TextDataModule, embedded, files
from parallama.data.mixture import shares
from parallama.data.sources import interleave
from parallama.errors import ConfigError
from parallama.tokenizer import byte_level, train_bpe

BASE = {"a": 0, "b": 20_000, "c": 40_000}  # token values name the source: sample j of "b" is token 20_000 + j


def _mixture(sizes: dict[str, int], weights: dict[str, float], seed: int = 0) -> MixtureDataset:
    """Sources of `sizes[name]` one-token samples (seq_len 1), sample j of a source holding BASE[name] + j."""
    datasets = {
        name: PackedDataset(np.arange(BASE[name], BASE[name] + size + 1, dtype=np.uint16), seq_len=1)
        for name, size in sizes.items()
    }
    return MixtureDataset(datasets, weights, seed)


def _trained(ds: MixtureDataset, seed: int, epochs=(0,)) -> list[tuple[str, int]]:
    """(source, sample) of every item in the train sampler's order, epoch after epoch; checks `index`."""
    sampler, out = EpochIndexSampler(ds, seed=seed), []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        for key in sampler:
            item = ds[key]
            assert key[0] == epoch and int(item["index"]) == key[1]
            token = int(item["input_ids"][0])
            name = max((n for n in BASE if BASE[n] <= token), key=BASE.get)
            assert ds.locate(epoch, key[1]) == (name, token - BASE[name])
            out.append((name, token - BASE[name]))
    return out


@pytest.mark.parametrize(
    "weights", [{"a": 0.7, "b": 0.3}, {"a": 5, "b": 3, "c": 2}], ids=["70-30", "3-way unnormalized"]
)
def test_shares_of_the_first_10k_samples_and_of_the_epoch(weights):
    sizes = {"a": 3_000, "b": 9_000, "c": 1_500}
    sizes = {name: sizes[name] for name in weights}
    ds = _mixture(sizes, weights)
    n, total = sum(sizes.values()), sum(weights.values())
    assert len(ds) == n  # an epoch: as many samples as the sources together
    epoch = _trained(ds, seed=0)
    counts = {name: sum(1 for s, _ in epoch if s == name) for name in weights}
    assert sum(counts.values()) == n
    for name, weight in weights.items():
        assert abs(counts[name] - weight / total * n) < 1  # the exact share, rounded
        first = sum(1 for s, _ in epoch[:10_000] if s == name) / 10_000
        assert abs(first - weight / total) < 0.01, (name, first)
    assert epoch == _trained(_mixture(sizes, weights), seed=0)  # same seed, same samples in the same order
    assert epoch != _trained(_mixture(sizes, weights, seed=1), seed=1)


def test_shares_add_up_exactly():
    assert shares(np.array([1.0, 1.0, 1.0]), 10).tolist() == [4, 3, 3]  # ties: the first
    assert shares(np.array([0.7, 0.3]), 1050).tolist() == [735, 315]
    for n in (1, 7, 999):
        counts = shares(np.array([0.5, 0.3, 0.15, 0.05]), n)
        assert counts.sum() == n and np.all(np.abs(counts - np.array([0.5, 0.3, 0.15, 0.05]) * n) < 1)


def test_a_small_source_repeats_pass_by_pass_and_a_large_one_is_subsampled_without_repeats():
    """ "a": 50 samples, 735 of 1,050 per epoch (14.7 passes); "b": 1,000 samples, 315 per epoch."""
    ds = _mixture({"a": 50, "b": 1_000}, {"a": 0.7, "b": 0.3})
    assert ds.counts.tolist() == [735, 315]
    trained = _trained(ds, seed=0, epochs=range(4))
    small = [j for s, j in trained if s == "a"]
    passes = [small[i : i + 50] for i in range(0, len(small) - 49, 50)]
    assert len(passes) == 58  # passes run on across epochs: 4 * 735 = 58.8 passes
    assert all(sorted(p) == list(range(50)) for p in passes)  # every sample once per pass, in training order
    assert len({tuple(p) for p in passes}) == len(passes)  # each pass another permutation
    large = [j for s, j in trained if s == "b"]
    assert len(large) == 4 * 315
    assert sorted(large[:1_000]) == list(range(1_000))  # every sample before any repeats, across epochs
    assert len(set(large[1_000:])) == 260  # the second pass begins
    assert ds[7] == ds[(0, 7)]  # a bare index (overfit_batches' sampler) is epoch 0


def test_interleave_feeds_a_tokenizer_in_proportion_until_a_source_runs_out():
    docs = {"a": ["x" * 9] * 100, "b": ["y" * 9] * 10}
    mixture = {name: (w, partial(iter, docs[name])) for name, w in (("a", 3.0), ("b", 1.0))}
    out = list(interleave(mixture))
    # 3:1 in characters: at 30 to 10 documents a tie goes to "a", then "b" runs out and the stream ends
    assert out.count("y" * 9) == 10 and out.count("x" * 9) == 31
    assert out == list(interleave(mixture))


def _dm(tmp_path, sources: dict, tokenizer=byte_level, **kw) -> TextDataModule:
    kw = {"seq_len": 32, "batch_size": 4, "cache_dir": str(tmp_path / "cache"), **kw}
    return TextDataModule(tokenizer=tokenizer, sources=sources, **kw)


def _corpora(prose: float = 0.7, code: float = 0.3, **more) -> dict:
    return {
        "prose": {"weight": prose, "source": partial(embedded, "prose", max_documents=6)},
        "code": {"weight": code, "source": partial(embedded, "code", max_documents=3)},
        **more,
    }


def test_each_source_has_its_own_cache_entry_and_a_new_weight_reuses_them(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="parallama")
    dm = _dm(tmp_path, _corpora())
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "index"} and batch["input_ids"].shape == (4, 32)
    assert len(dm.val_dataloader()) >= 1
    entries = {name: part.data_dir for name, part in dm.parts.items()}
    assert len(set(entries.values())) == 2
    assert dm._order()["token cache"] == ", ".join(
        f"{n}={entries[n].rsplit('/', 1)[1]}" for n in sorted(entries)
    )

    caplog.clear()
    reweighted = _dm(tmp_path, _corpora(prose=0.5, code=0.5))
    reweighted.setup("fit")
    assert "building token cache" not in caplog.text  # another weight tokenizes nothing
    assert {name: part.data_dir for name, part in reweighted.parts.items()} == entries
    assert reweighted._order()["data.sources"] == {"code": 0.5, "prose": 0.5} != dm._order()["data.sources"]
    assert len(reweighted.datasets["train"]) == len(dm.datasets["train"])

    caplog.clear()
    extra = {"notes": {"weight": 1, "source": partial(embedded, "prose", max_documents=2)}}
    grown = _dm(tmp_path, _corpora(**extra))
    grown.prepare_data()
    assert caplog.text.count("building token cache") == 1  # only the new source
    assert all(grown.parts[name].data_dir == entries[name] for name in entries)


def test_document_mask_reaches_every_source(tmp_path):
    dm = _dm(tmp_path, _corpora(), document_mask=True)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert {"position_ids", "document_ids"} <= set(batch)
    assert all(part.document_mask for part in dm.parts.values())


def test_a_trained_tokenizer_reads_every_source_and_is_keyed_on_the_weights(tmp_path):
    bpe = partial(train_bpe, vocab_size=300)
    dm, reweighted = _dm(tmp_path, _corpora(), bpe), _dm(tmp_path, _corpora(prose=0.5, code=0.5), bpe)
    docs = list(interleave(dm.mixture))
    assert set(docs) & set(embedded("code", max_documents=3)) and set(docs) & set(embedded(max_documents=6))
    assert dm.tokenizer.to_str() == train_bpe(docs, vocab_size=300).to_str()
    assert reweighted.tokenizer.to_str() != dm.tokenizer.to_str()
    assert len(list((tmp_path / "cache").glob("tokenizer-*.json"))) == 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"source": partial(embedded)}, "data.source and data.sources are both set"),
        ({"sources": None}, "data.source is not set"),
        ({"sources": {}}, "data.sources={} is not valid"),
        ({"sources": _corpora(code=0)}, "data.sources.code.weight=0 is not valid; use a number > 0"),
        ({"sources": _corpora(code=-1.5)}, "data.sources.code.weight=-1.5 is not valid"),
        ({"sources": _corpora(code="abc")}, "data.sources.code.weight='abc' is not valid"),
        ({"sources": _corpora(code=True)}, "data.sources.code.weight=True is not valid"),
        ({"sources": {"web": {"weight": 1}}}, "data.sources.web must be {weight:"),
        ({"sources": {"web": {"weight": 1, "source": [], "wieght": 2}}}, "data.sources.web must be"),
        (
            {"sources": {"web": {"weight": 1, "source": embedded()}}},
            "data.sources.web.source is not a source",
        ),
        (
            {"sources": {"web": {"weight": 1, "source": partial(files, "nothing-*.txt")}}},
            "data.sources.web: data.source.paths='nothing-*.txt' matches no file",
        ),
    ],
)
def test_bad_mixtures_are_one_line_errors(tmp_path, change, message):
    with pytest.raises((ConfigError, FileNotFoundError)) as err:
        TextDataModule(
            **{"tokenizer": byte_level, "cache_dir": str(tmp_path), "sources": _corpora(), **change}
        )
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_source_without_train_samples_is_named(tmp_path):
    (tmp_path / "tiny.txt").write_text("x")  # 3 tokens: no sample of 32
    tiny = {"tiny": {"weight": 1, "source": partial(files, str(tmp_path / "tiny.txt"))}}
    with pytest.raises(ConfigError, match=r"^data\.sources\.tiny: data: the train split has 0 samples"):
        _dm(tmp_path, {**_corpora(), **tiny}).setup("fit")


# --- resume -----------------------------------------------------------------


def test_a_resumed_sampler_continues_with_the_same_items():
    """Items depend only on (epoch, index), so a sampler started mid-epoch (as a resume does) yields the rest of
    the uninterrupted epoch's items; a new epoch draws other samples of a subsampled source."""
    ds = _mixture({"a": 50, "b": 1_000}, {"a": 0.7, "b": 0.3})
    straight = EpochIndexSampler(ds, seed=5)
    straight.set_epoch(1)
    keys = list(straight)
    resumed = EpochIndexSampler(_mixture({"a": 50, "b": 1_000}, {"a": 0.7, "b": 0.3}), seed=5)
    resumed.start_at(1, 400)
    assert list(resumed) == keys[400:]
    assert all(torch.equal(ds[k]["input_ids"], resumed.dataset[k]["input_ids"]) for k in keys[400:])
    assert {ds.locate(0, i) for i in range(len(ds))} != {ds.locate(1, i) for i in range(len(ds))}


@pytest.mark.parametrize(
    "change, message",
    [
        (_corpora(code=0.4), "with data.sources={'code': 0.3, 'prose': 0.7} but this run has {'code': 0.4, "),
        (
            _corpora(code=3, prose=7),
            "with data.sources={'code': 0.3, 'prose': 0.7} but this run has {'code': 3.0",
        ),
        (_corpora(notes={"weight": 1, "source": partial(embedded, max_documents=2)}), "data.sources="),
        ({"prose": _corpora()["prose"]}, "data.sources="),
    ],
    ids=["weight", "scaled weights", "added source", "removed source"],
)
def test_resuming_another_mixture_is_refused(tmp_path, change, message):
    """The CLI prints the same check_resume line (test_resume_settings covers its one-line form)."""
    saved = _dm(tmp_path, _corpora())._order()
    with pytest.raises(ConfigError, match=re.escape(message)):
        _dm(tmp_path, change).check_resume(saved, source="ckpt")
    single = _dm(tmp_path, None, source=partial(embedded, max_documents=6))
    with pytest.raises(ConfigError, match="was trained with token cache=code="):
        single.check_resume(saved, source="ckpt")


CONSTANT_LR = ["scheduler.warmup_steps=0", "scheduler.min_lr_ratio=1"]  # a run's schedule ignores its length
