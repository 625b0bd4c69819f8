"""Document sources (Hydra `_target_`s, used as `_partial_: true`).

Each call returns a fresh iterable of document strings in a deterministic order, so
the datamodule can take one pass to train a tokenizer and another to tokenize.
Errors are raised eagerly where possible and are one line naming the config key.
"""

from __future__ import annotations

import glob
import itertools
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

from datasets import load_dataset

from parallama.errors import ConfigError

CORPORA = ("prose", "code")
BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_NOT_CODE = {"test", "tests", "idle_test", "site-packages", "dist-packages"}


def embedded(corpus: str = "prose", max_documents: int | None = None) -> Iterable[str]:
    """Corpora shipped with every CPython, for runs without network or downloads.

    "prose": the pydoc help topics (79 docs, ~465 KB); "code": the standard library's
    own `.py` files (tests excluded), one document per file.
    """
    if corpus == "prose":
        from pydoc_data.topics import topics

        docs: Iterable[str] = (topics[k] for k in sorted(topics))
    elif corpus == "code":
        docs = (p.read_bytes().decode("utf-8", errors="replace") for p in _stdlib_sources())
    else:
        raise ConfigError(f"data.source.corpus={corpus!r} is unknown; valid: {', '.join(CORPORA)}")
    return itertools.islice(docs, max_documents)


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = (p for p in root.rglob("*.py") if not _NOT_CODE & set(p.relative_to(root).parts[:-1]))
    return sorted(paths, key=lambda p: p.relative_to(root).as_posix())


def files(paths: str | list[str], text_key: str = "text", max_documents: int | None = None) -> Iterable[str]:
    """Local files read with `datasets.load_dataset` (streaming, so nothing is cached):
    `.txt`/`.md` hold one document per file, `.jsonl`/`.json`/`.parquet` one per record
    (field `text_key`). Globs are expanded; files are read in sorted order per pattern."""
    patterns = [paths] if isinstance(paths, str) else list(paths)
    if not patterns:
        raise ConfigError("data.source.paths is empty; give a file, a glob or a list of them")
    matched = []
    for pattern in patterns:
        hits = [
            p for p in sorted(glob.glob(os.path.expanduser(pattern), recursive=True)) if os.path.isfile(p)
        ]
        if not hits:
            raise FileNotFoundError(f"data.source.paths={pattern!r} matches no file")
        matched += hits
    for path in matched:
        if _ext(path) not in BUILDERS:
            raise ConfigError(
                f"data.source.paths: {path!r} has unsupported extension; valid: {', '.join(BUILDERS)}"
            )
    docs = itertools.chain.from_iterable(_read(path, text_key) for path in matched)
    return itertools.islice(docs, max_documents)


def _ext(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _read(path: str, text_key: str) -> Iterator[str]:
    key = "text" if BUILDERS[_ext(path)] == "text" else text_key
    for row in _rows(path):
        if key not in row:
            raise ConfigError(f"data.source.text_key={key!r} not in {path}; columns: {sorted(row)}")
        yield row[key]


def _rows(path: str) -> Iterator[dict]:
    builder = BUILDERS[_ext(path)]
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        yield from load_dataset(builder, data_files=path, split="train", streaming=True, **options)
    except Exception as e:  # whatever the reader raises, say which file it choked on
        raise ConfigError(f"data.source.paths: cannot read {path}: {_one_line(e)}") from e


def _one_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


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
    ds = load_dataset(name, config_name, split=split, streaming=streaming)
    if ds.column_names is not None:
        if text_key not in ds.column_names:
            raise ConfigError(f"data.source.text_key={text_key!r} not in {name}; columns: {ds.column_names}")
        ds = ds.select_columns([text_key])  # skip decoding the other columns
    docs = (row[text_key] for row in ds)
    return itertools.islice(docs, max_documents)
