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
import glob
import itertools
import json
import logging
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

from parallama.errors import ConfigError
from parallama.rules import Rule, key

CORPORA = ("prose", "code")
BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
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
    docs = itertools.chain.from_iterable(_read(path, text_key) for path in matched)
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
        ext = _ext(path)
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


def check_paths(paths: str | list[str]) -> list[str]:
    """Expand the patterns, check what can be checked without reading: existence, type, extension, size (also
    the preflight's check of the paths, `files.check_inputs`)."""
    patterns = [paths] if isinstance(paths, str) else list(paths)
    if not patterns:
        raise ConfigError("data.source.paths is empty; give a file, a glob or a list of them")
    matched = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if os.path.isdir(expanded):
            raise ConfigError(
                f"data.source.paths: {pattern!r} is a directory; give files or a glob such as "
                f"{_glob_for(pattern, expanded)!r}"
            )
        hits = sorted(glob.glob(expanded, recursive=True))
        if not hits:
            raise FileNotFoundError(f"data.source.paths={pattern!r} matches no file")
        if not (file_hits := [p for p in hits if os.path.isfile(p)]):
            raise ConfigError(f"data.source.paths={pattern!r} matches only directories, e.g. {hits[0]!r}")
        matched += file_hits
    for path in matched:
        if _ext(path) not in BUILDERS:
            raise ConfigError(
                f"data.source.paths: {path!r} has unsupported extension; valid: {', '.join(BUILDERS)}"
            )
        if os.path.getsize(path) == 0:
            raise ConfigError(f"data.source.paths: {path} is empty (0 bytes); remove it or the pattern")
    return matched


def _glob_for(pattern: str, folder: str) -> str:
    """The glob to suggest for a folder: its most common readable extension, in the folder itself or else
    below it (`**`); `*.jsonl` when it holds none."""
    base = pattern.rstrip("/")
    for where, found in (
        ("*", glob.glob(os.path.join(folder, "*"))),
        ("**/*", glob.glob(os.path.join(folder, "**", "*"), recursive=True)),
    ):
        counts: dict[str, int] = {}
        for path in found:
            if os.path.isfile(path) and _ext(path) in BUILDERS:
                counts[_ext(path)] = counts.get(_ext(path), 0) + 1
        if counts:
            return f"{base}/{where}{max(sorted(counts), key=counts.get)}"
    return f"{base}/*.jsonl"


def _ext(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _read(path: str, text_key: str) -> Iterator[str]:
    key = "text" if BUILDERS[_ext(path)] == "text" else text_key
    record = 0
    for record, row in enumerate(_rows(path), 1):
        if key not in row:
            raise ConfigError(f"data.source.text_key={key!r} not in {path}; columns: {sorted(row)}")
        yield _text(row[key], key, path, record)
    if record == 0:
        raise ConfigError(f"data.source.paths: {path} has no records")


def _text(text: object, key: str, where: str, record: int) -> str:
    """`text`, if it is a string; else the error a tokenizer's TypeError would not give: which record."""
    if not isinstance(text, str):
        what = "missing or null" if text is None else f"a {type(text).__name__}, not a string"
        raise ConfigError(f"data.source.text_key={key!r} in {where} record {record} is {what}")
    return text


def _rows(path: str) -> Iterator[dict]:
    builder = BUILDERS[_ext(path)]
    options = {"sample_by": "document"} if builder == "text" else {}
    json_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_log.level
    json_log.setLevel(logging.CRITICAL)  # it logs the parse error we are about to raise as one line
    # imported here: `datasets` takes seconds to import, and the preflight's check of the paths needs none of it
    from datasets import load_dataset  # start-up time (datasets)

    try:
        yield from load_dataset(builder, data_files=path, split="train", streaming=True, **options)
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.source.paths: {path} is not valid UTF-8 ({e}); files must be UTF-8") from e
    except Exception as e:  # whatever the reader raises, say which file it choked on
        if builder == "json" and (where := _json_error(path)) is not None:
            raise ConfigError(f"data.source.paths: {path} {where}") from e
        raise ConfigError(f"data.source.paths: cannot read {path}: {_one_line(e)}") from e
    finally:
        json_log.setLevel(level)


def _json_error(path: str) -> str | None:
    """Where a JSON file stops parsing, counted as the other data errors count: records from 1 (Arrow says `row
    100`, from 0 within the block it read, and calls an unterminated string "Invalid encoding in string").
    None where Python reads it whole."""

    with open(path, "rb") as f:
        if f.read(64).lstrip().startswith(b"["):  # one JSON array
            try:
                json.loads(f.seek(0) or f.read())
            except UnicodeDecodeError:
                return "is not valid UTF-8; files must be UTF-8"
            except json.JSONDecodeError as e:
                return f"is not valid JSON: {e.msg.removesuffix(' at')} at line {e.lineno} column {e.colno}"
            return None
        f.seek(0)
        lines = (line for line in enumerate(f, 1) if line[1].strip())  # records: the lines that are not blank
        for record, (number, line) in enumerate(lines, 1):
            at = f"record {record} (line {number})"
            try:
                value = json.loads(line.rstrip(b"\r\n"))
            except UnicodeDecodeError:
                return f"{at} is not valid UTF-8; files must be UTF-8"
            except json.JSONDecodeError as e:
                return f"{at} is not valid JSON: {e.msg.removesuffix(' at')} at column {e.colno}"
            if not isinstance(value, dict):
                return f"{at} is a JSON {type(value).__name__}, not an object with a text field"
    return None


def _one_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


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
    docs = (_text(row.get(text_key), text_key, name, record) for record, row in enumerate(ds, 1))
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
