"""Local files as documents: the paths checked before any work (existence, type, extension, size), then each
file read one document at a time with `datasets` (streaming), every error one line naming the file and record.
The `files` source (sources.py) is built on it.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

from parallama.errors import ConfigError

BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


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
        if file_extension(path) not in BUILDERS:
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
            if os.path.isfile(path) and file_extension(path) in BUILDERS:
                counts[file_extension(path)] = counts.get(file_extension(path), 0) + 1
        if counts:
            return f"{base}/{where}{max(sorted(counts), key=counts.get)}"
    return f"{base}/*.jsonl"


def file_extension(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def read_documents(path: str, text_key: str) -> Iterator[str]:
    key = "text" if BUILDERS[file_extension(path)] == "text" else text_key
    record = 0
    for record, row in enumerate(_rows(path), 1):
        if key not in row:
            raise ConfigError(f"data.source.text_key={key!r} not in {path}; columns: {sorted(row)}")
        yield document_text(row[key], key, path, record)
    if record == 0:
        raise ConfigError(f"data.source.paths: {path} has no records")


def document_text(text: object, key: str, where: str, record: int) -> str:
    """`text`, if it is a string; else the error a tokenizer's TypeError would not give: which record."""
    if not isinstance(text, str):
        what = "missing or null" if text is None else f"a {type(text).__name__}, not a string"
        raise ConfigError(f"data.source.text_key={key!r} in {where} record {record} is {what}")
    return text


def _rows(path: str) -> Iterator[dict]:
    builder = BUILDERS[file_extension(path)]
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
