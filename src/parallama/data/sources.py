"""Document sources (Hydra `_target_`s, used as `_partial_: true`).

Each call returns a fresh iterable of document strings in a deterministic order, so
the datamodule can take one pass to train a tokenizer and another to tokenize.
Errors are raised eagerly where possible and are one line naming the config key and
the file (and record). A source's `fingerprint` attribute, called with the same
arguments, returns what its documents depend on beyond the config: the token cache
key includes it, so changed inputs get a new cache entry. Its `num_documents` attribute
returns how many documents to expect, or None (only progress lines use it, for an ETA).
Before any work the config check asks a source (app/checks.py, whatever its `_target_`) for its `config_keys`
(a dataclass of `rules.key` fields mirroring its conf file) and calls its `check_inputs`, with the same
arguments, to check the files it reads.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any, ClassVar

from parallama.data.local_files import BUILDERS, check_paths, document_text, file_extension, read_documents
from parallama.errors import ConfigError
from parallama.rules import Rule, key

CORPORA = ("prose", "code")
_NOT_CODE = {"test", "tests", "idle_test", "site-packages", "dist-packages"}
MAX_DOCUMENTS = Rule(int, 1, allow=(None,))  # a count, or null: all


@dataclass
class EmbeddedKeys:
    conf: ClassVar[str] = "data/source/embedded.yaml"

    corpus: str = key("prose", Rule(str, choices=CORPORA))
    max_documents: int | None = key(None, MAX_DOCUMENTS)


def embedded(corpus: str = "prose", max_documents: int | None = None) -> Iterable[str]:
    """Corpora shipped with every CPython, for runs without network or downloads.

    "prose": the pydoc help topics (79 docs, ~465 KB); "code": the standard library's
    own `.py` files (tests excluded), one document per file.
    """
    if corpus == "prose":
        docs: Iterable[str] = (topics[k] for k in sorted(topics))
    elif corpus == "code":
        docs = (p.read_bytes().decode("utf-8", errors="replace") for p in _stdlib_sources())
    else:
        raise ConfigError(f"data.source.corpus={corpus!r} is unknown; valid: {', '.join(CORPORA)}")
    return itertools.islice(docs, max_documents)


def _embedded_fingerprint(corpus: str = "prose", max_documents: int | None = None) -> list:
    """Both corpora ship with CPython, so they change only with the Python build."""
    return [sys.version]


def _embedded_count(corpus: str = "prose", max_documents: int | None = None) -> int | None:
    if corpus not in CORPORA:
        return None
    if corpus == "prose":
        n = len(topics)
    else:
        n = len(_stdlib_sources())
    return min(n, max_documents) if max_documents is not None else n


embedded.config_keys = EmbeddedKeys
embedded.fingerprint = _embedded_fingerprint
embedded.num_documents = _embedded_count


@functools.cache  # the stdlib does not change while we run; the scan takes a second
def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = (p for p in root.rglob("*.py") if not _NOT_CODE & set(p.relative_to(root).parts[:-1]))
    return sorted(paths, key=lambda p: p.relative_to(root).as_posix())


@dataclass
class FilesKeys:
    conf: ClassVar[str] = "data/source/files.yaml"

    paths: Any = key("???")  # a path, a glob or a list: matched by `check_inputs` before any work
    text_key: str = key("text")
    max_documents: int | None = key(None, MAX_DOCUMENTS)


def files(paths: str | list[str], text_key: str = "text", max_documents: int | None = None) -> Iterable[str]:
    """Local files read with `datasets.load_dataset` (streaming, so nothing is cached):
    `.txt`/`.md` hold one document per file, `.jsonl`/`.json`/`.parquet` one per record
    (field `text_key`, which must be a string). Globs are expanded; files are read in sorted
    order per pattern. Files must be UTF-8 and not empty."""
    matched = check_paths(paths)
    docs = itertools.chain.from_iterable(read_documents(path, text_key) for path in matched)
    return itertools.islice(docs, max_documents)


def _files_fingerprint(
    paths: str | list[str], text_key: str = "text", max_documents: int | None = None
) -> list:
    """Path, size and mtime_ns of every matched file: an edit in place changes the cache key."""
    return [[os.path.abspath(p), (st := os.stat(p)).st_size, st.st_mtime_ns] for p in check_paths(paths)]


def _files_count(
    paths: str | list[str], text_key: str = "text", max_documents: int | None = None
) -> int | None:
    """Exact where cheap: one per .txt/.md file, parquet row counts from the footer, jsonl line counts (a
    read at disk speed); a .json array makes it unknown."""
    import pyarrow.parquet as pq  # start-up time (pyarrow: the config check imports this module)

    total = 0
    for path in check_paths(paths):
        ext = file_extension(path)
        if BUILDERS[ext] == "text":
            total += 1
        elif ext == ".parquet":
            total += pq.ParquetFile(path).metadata.num_rows
        elif ext == ".jsonl":
            with open(path, "rb") as f:
                total += sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b""))
        else:
            return max_documents
    return min(total, max_documents) if max_documents is not None else total


def _files_inputs(paths: str | list[str], text_key: str = "text", max_documents: int | None = None) -> None:
    """The paths match files it can read (the preflight's check, before any work)."""
    check_paths(paths)


files.config_keys = FilesKeys
files.check_inputs = _files_inputs
files.fingerprint = _files_fingerprint
files.num_documents = _files_count


@dataclass
class HubKeys:
    conf: ClassVar[str] = "data/source/hub.yaml"  # fineweb.yaml: the same keys, FineWeb's values

    name: str = key("???")
    config_name: str | None = key(None)
    split: str = key("train")
    text_key: str = key("text")
    streaming: bool = key(True, Rule(bool))
    max_documents: int | None = key(None, MAX_DOCUMENTS)


def hub(
    name: str,
    config_name: str | None = None,
    split: str = "train",
    text_key: str = "text",
    streaming: bool = True,
    max_documents: int | None = None,
) -> Iterable[str]:
    """A Hugging Face dataset (or anything `load_dataset(name)` accepts, e.g. a local
    folder). Streaming reads only what is used: cap web-scale sets with `max_documents`."""
    from datasets import load_dataset  # start-up time (datasets)

    ds = load_dataset(name, config_name, split=split, streaming=streaming)
    if ds.column_names is not None:
        if text_key not in ds.column_names:
            raise ConfigError(f"data.source.text_key={text_key!r} not in {name}; columns: {ds.column_names}")
        ds = ds.select_columns([text_key])  # skip decoding the other columns
    docs = (document_text(row.get(text_key), text_key, name, record) for record, row in enumerate(ds, 1))
    return itertools.islice(docs, max_documents)


def _hub_count(*args, max_documents: int | None = None, **kwargs) -> int | None:
    """Only a cap is known without asking the Hub."""
    return max_documents


hub.config_keys = HubKeys
hub.num_documents = _hub_count


# --- mixtures of sources (`data.sources`; the datasets that mix them: `mixture`) --------------------------------

Mixture = dict[str, tuple[float, Callable[[], Iterable[str]]]]  # name -> (weight as configured, source)
ENTRY = "{weight: <number > 0>, source: <a data/source config>}"


def mixture_sources(source: Callable | None, sources: Mapping | None) -> Mixture | None:
    """The mixture `data.sources` configures, or None for the single `data.source`. Weights stay as configured
    (only their ratios matter: users read them back in resume errors). Each bad setting is a one-line
    ConfigError naming its key."""
    if sources is None:
        if source is None:
            raise ConfigError(
                "data.source is not set: choose one (data/source=embedded, files, hub or fineweb) "
                "or mix several with data.sources"
            )
        return None
    if source is not None:
        raise ConfigError(
            "data.source and data.sources are both set: mixing takes data.sources alone; drop data.source "
            "(`~data/source` on the command line, `override /data/source: null` in an experiment, as "
            "experiment=mixture does) or set data.sources=null"
        )
    if not isinstance(sources, Mapping) or not sources:
        raise ConfigError(f"data.sources={sources!r} is not valid; give {{name: {ENTRY}, ...}} or null")
    mixture: Mixture = {}
    for name, entry in sources.items():
        key = f"data.sources.{name}"
        if not isinstance(entry, Mapping) or set(entry) != {"weight", "source"}:
            has = sorted(entry) if isinstance(entry, Mapping) else repr(entry)
            raise ConfigError(f"{key} must be {ENTRY}; it has {has}")
        weight = entry["weight"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
            raise ConfigError(
                f"{key}.weight={weight!r} is not valid; use a number > 0 (weights are normalized to sum to 1)"
            )
        if not callable(entry["source"]):
            raise ConfigError(
                f"{key}.source is not a source; give a data/source config (its _target_ with _partial_: true)"
            )
        mixture[str(name)] = (float(weight), entry["source"])
    return mixture


def interleave(mixture: Mixture) -> Iterator[str]:
    """The documents a tokenizer is trained on for a mixture: each next one from the source furthest below its
    weight's share of the characters so far (ties: by name), until the first source runs out."""
    streams = {name: iter(mixture[name][1]()) for name in sorted(mixture)}
    chars = dict.fromkeys(streams, 0)
    while True:
        name = min(streams, key=lambda n: chars[n] / mixture[n][0])
        doc = next(streams[name], None)
        if doc is None:
            return
        chars[name] += len(doc) + 1  # + 1: empty documents count too
        yield doc


def mixture_key(mixture: Mixture) -> list:
    """What a tokenizer trained on the mixture depends on: every source's key and the weights."""
    from parallama.data.cache import source_key  # start-up time (rich, tokenizers)

    keys = []
    for name, (weight, source) in sorted(mixture.items()):
        with named(name):
            keys.append([name, weight, source_key(source)])
    return ["mixture", keys]


@contextmanager
def named(name: str) -> Iterator[None]:
    """Errors about one source of a mixture say which: `data.sources.<name>: ...`."""
    try:
        yield
    except (ConfigError, FileNotFoundError) as err:
        raise type(err)(f"data.sources.{name}: {err}") from err
