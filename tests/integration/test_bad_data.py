"""Bad data stops before any training with one line naming the file (and record and key).

The table holds 35 distinct bad files or inputs for the `files` source; then a Hub record, the data
module's own checks (no documents, a train split smaller than one step, nothing cached on failure) and
one CLI run: a bad record prints exactly one `error:` line and exits with status 2, no traceback.
"""

import json
from functools import partial

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import train

from parallama.data import TextDataModule, byte_level, files, hub
from parallama.errors import ConfigError

GARBAGE = bytes(range(256)) * 4  # deterministic binary junk, invalid UTF-8 and invalid JSON


def jsonl(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def parquet(**columns):
    return pa.table(columns)


# (id, {file name: content}, paths (None: the only file), text_key, what the message must also say)
CASES = [
    ("missing-file", {}, "nope.jsonl", "text", ["matches no file"]),
    ("glob-matches-nothing", {"a.txt": "x"}, "*.jsonl", "text", ["matches no file"]),
    ("directory", {"corpus/a.txt": "x", "corpus/b.txt": "y", "corpus/c.jsonl": jsonl({"text": "z"})}, "corpus",
     "text", ["is a directory", "/corpus/*.txt'"]),  # the glob of the files that are there
    ("directory-of-folders", {"shards/1/a.jsonl": jsonl({"text": "a"})}, "shards", "text", ["/shards/**/*.jsonl'"]),
    ("glob-only-directories", {"d1/a.txt": "x"}, "d*", "text", ["matches only directories"]),
    ("csv-extension", {"data.csv": "text\nx\n"}, None, "text", ["unsupported extension", ".jsonl"]),
    ("no-extension", {"README": "x"}, None, "text", ["unsupported extension"]),
    ("gzip-jsonl", {"data.jsonl.gz": GARBAGE}, None, "text", ["unsupported extension"]),
    ("empty-txt", {"empty.txt": ""}, None, "text", ["is empty"]),
    ("empty-jsonl", {"empty.jsonl": ""}, None, "text", ["is empty"]),
    ("empty-parquet-file", {"empty.parquet": b""}, None, "text", ["is empty"]),
    ("blank-lines-jsonl", {"blank.jsonl": "\n\n  \n"}, None, "text", ["has no records"]),
    ("empty-json-array", {"none.json": "[]"}, None, "text", ["has no records"]),
    ("zero-row-parquet", {"rows.parquet": parquet(text=pa.array([], pa.string()))}, None, "text", ["cannot read"]),
    ("binary-jsonl", {"junk.jsonl": GARBAGE}, None, "text", ["record 1 (line 1) is not valid JSON"]),
    ("broken-line-jsonl", {"broken.jsonl": '{"text": "a"}\n{"text": "b"\n'}, None, "text",
     ["record 2 (line 2) is not valid JSON"]),
    ("null-text", {"n.jsonl": jsonl({"text": "a"}, {"text": None})}, None, "text", ["record 2", "null"]),
    ("int-text", {"i.jsonl": jsonl({"text": "a"}, {"text": "b"}, {"text": 5})}, None, "text", ["record 3", "int"]),
    ("list-text", {"l.jsonl": jsonl({"text": ["a"]})}, None, "text", ["record 1", "list"]),
    ("object-text", {"o.jsonl": jsonl({"text": {"a": 1}})}, None, "text", ["record 1", "dict"]),
    ("key-missing-in-a-record", {"m.jsonl": jsonl({"text": "a"}, {"body": "b"})}, None, "text", ["record 2"]),
    ("text-key-not-a-column", {"c.jsonl": jsonl({"body": "a"})}, None, "text", ["columns", "body"]),
    ("other-text-key", {"t.jsonl": jsonl({"text": "a"})}, None, "content", ["'content'", "columns"]),
    ("records-not-objects", {"s.jsonl": '"just a string"\n"b"\n'}, None, "text",
     ["record 1 (line 1) is a JSON str, not an object"]),
    ("json-array-null", {"arr.json": '[{"text": "a"}, {"text": null}]'}, None, "text", ["record 2"]),
    ("json-garbage", {"bad.json": "not json at all"}, None, "text", ["record 1 (line 1) is not valid JSON"]),
    ("json-array-broken", {"arr.json": '[{"text": "a"},\n {"text": "b"\n]'}, None, "text",
     ["is not valid JSON: Expecting ',' delimiter at line 3 column 1"]),
    ("parquet-without-column", {"p.parquet": parquet(body=["a"])}, None, "text", ["columns", "body"]),
    ("parquet-int-column", {"p.parquet": parquet(text=[1, 2])}, None, "text", ["record 1", "int"]),
    ("parquet-null", {"p.parquet": parquet(text=["a", None])}, None, "text", ["record 2", "null"]),
    ("parquet-garbage", {"p.parquet": b"garbage, not parquet"}, None, "text", ["cannot read"]),
    ("txt-invalid-utf8", {"latin1.txt": "café".encode("latin-1")}, None, "text", ["not valid UTF-8"]),
    ("md-binary", {"junk.md": GARBAGE}, None, "text", ["not valid UTF-8"]),
    ("second-file-bad", {"a.jsonl": jsonl({"text": "a"}), "b.jsonl": jsonl({"text": None})}, "*.jsonl", "text",
     ["b.jsonl", "record 1"]),
    # found: Arrow's `row 100` (from 0) and "Invalid encoding in string" for an unterminated string on line 101
    ("broken-line-101", {"long.jsonl": jsonl(*[{"text": "a"}] * 100) + '{"text": "b\n'}, None, "text",
     ["record 101 (line 101) is not valid JSON: Unterminated string starting at column 10"]),
]  # fmt: skip


def _write(root, name, content) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, pa.Table):
        pq.write_table(content, path)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


def test_the_table_is_what_the_docstring_says():
    assert len(CASES) == len({case[0] for case in CASES}) == 35


@pytest.mark.parametrize(
    ("name", "contents", "paths", "text_key", "needles"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_file_is_one_line_naming_it(tmp_path, name, contents, paths, text_key, needles):
    for file_name, content in contents.items():
        _write(tmp_path, file_name, content)
    paths = paths or next(iter(contents))
    named = paths if name != "second-file-bad" else "b.jsonl"
    with pytest.raises((ConfigError, FileNotFoundError)) as e:
        list(files(str(tmp_path / paths), text_key=text_key))
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    for needle in ["data.source.", named.split("/")[0], *needles]:
        assert needle in msg, (needle, msg)
    field = not any("JSON" in n for n in needles)  # not the file's JSON syntax
    if field and any(n.startswith("record ") or n == "columns" for n in needles):  # a field's fault: the key
        assert f"text_key={text_key!r}" in msg, msg


def test_hub_record_that_is_not_text(tmp_path):
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "part0.jsonl").write_text(jsonl({"text": "a"}, {"text": None}))
    with pytest.raises(ConfigError) as e:
        list(hub(str(tmp_path / "set")))
    assert str(e.value) == f"data.source.text_key='text' in {tmp_path / 'set'} record 2 is missing or null"


def _dm(tmp_path, paths, **kw):
    kw = {"seq_len": 8, "batch_size": 4, "val_fraction": 0.0, "cache_dir": str(tmp_path / "cache"), **kw}
    return TextDataModule(
        source=partial(files, paths=str(paths), **kw.pop("source", {})), tokenizer=partial(byte_level), **kw
    )


def test_bad_record_fails_the_build_and_caches_nothing(tmp_path):
    (tmp_path / "a.jsonl").write_text(jsonl({"text": "fine"}) * 50 + jsonl({"text": 7}))
    dm = _dm(tmp_path, tmp_path / "a.jsonl")
    with pytest.raises(ConfigError, match=r"a\.jsonl record 51 is a int, not a string"):
        dm.prepare_data()
    assert list((tmp_path / "cache").iterdir()) == []  # no entry and no temporary left behind


def test_missing_path_is_found_when_the_datamodule_is_built(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        _dm(tmp_path, tmp_path / "nope.txt")


def test_no_documents(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ConfigError) as e:
        _dm(tmp_path, tmp_path / "a.txt", source={"max_documents": 0}).prepare_data()
    assert str(e.value) == "data.source yielded no documents"


def test_train_split_smaller_than_one_step(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 20)  # 22 tokens: 2 samples of seq_len 8, but a step needs 4
    dm = _dm(tmp_path, tmp_path / "a.txt")
    dm.setup(
        "validate"
    )  # the validation before training opens the splits first (found: the check was skipped)
    with pytest.raises(ConfigError) as e:
        dm.setup("fit")
    assert str(e.value) == (
        "data: the train split has 2 samples of seq_len 8 (22 tokens) but one step needs "
        "data.batch_size * world size = 4; use more data or lower data.batch_size/data.seq_len"
    )
    fits = _dm(tmp_path, tmp_path / "a.txt", batch_size=2)
    fits.setup("fit")
    assert len(fits.train_dataloader()) == 1


def test_cli_bad_record_is_one_error_line(tmp_path, data_cache):
    (tmp_path / "bad.jsonl").write_text(jsonl({"text": "a fine document"}, {"text": None}))
    proc = train(
        "data/source=files", f"data.source.paths={tmp_path / 'bad.jsonl'}",
        cwd=tmp_path, cache=data_cache, run_dir=tmp_path / "run", check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "error:" in line]
    assert proc.returncode == 2, out[-3000:]
    assert len(errors) == 1 and errors[0].endswith(
        f"error: data.source.text_key='text' in {tmp_path / 'bad.jsonl'} record 2 is missing or null"
    ), out[-3000:]
    assert "Traceback" not in out


def test_a_validation_split_that_comes_out_empty_is_one_line(tmp_path):
    """Found: one 50 MB document trained with `final metrics: {}` and Lightning's generic warning: documents are
    held out whole, so one document leaves no validation split."""
    (tmp_path / "one.txt").write_text("x" * 200)
    dm = _dm(tmp_path, tmp_path / "one.txt", val_fraction=0.05)
    with pytest.raises(ConfigError) as e:
        dm.setup("fit")
    assert str(e.value) == (
        "data: the validation split is empty (0 of 1 documents held out, 0 tokens, fewer than a sample of "
        "data.seq_len=8; documents are held out whole, data.val_fraction=0.05 of them): use more documents (split "
        "a long one into several), raise data.val_fraction, or train without validation with data.val_fraction=0"
    )
    _dm(tmp_path, tmp_path / "one.txt", val_fraction=0.0).setup("fit")  # no validation asked: it trains
