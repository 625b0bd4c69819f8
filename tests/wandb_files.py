"""Reading an offline W&B run from its files (wandb 0.31 writes no config.yaml offline: the config is inside
the `.wandb` log)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2


def wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` file: a LevelDB-style log (7-byte file header, 32 KiB blocks, each
    record in chunks behind a 7-byte header: crc32, length, type full=1/first=2/middle=3/last=4)."""
    data, records, chunk, pos, block = path.read_bytes(), [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in this block for a header: padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return records


def wandb_run(run_dir: Path) -> dict:
    """The one offline W&B run of a run directory: id, group, tags, config and logged history."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run = {"config": {}, "history": []}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, group=record.run.run_group, tags=list(record.run.tags))
        elif kind == "config":
            run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            run["history"].append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return run
