"""`checksum`: what checkpoint checksums cost (checkpoint/integrity.py), in seconds per GB of checkpoint, for a
single file and a DCP folder.

The state is a checkpoint's: fp32 weights and AdamW's two moments, 12 bytes a parameter (Llama-3.2-1B's 1.24 B
parameters make ~15 GB; `--gb` sizes it to what the machine holds), in 64 MB tensors. Each arm is timed
`--repeats` times, alternating, on the same disk (`--dir`), median reported:

- file: torch.save to a temp file, fsynced and renamed (`plain`: the write before checksums) against
  `atomic.save_file` (the same, hashed while torch.save writes it, with its sidecar: `checksummed`);
- dcp: torch.distributed.checkpoint's save in one process (`plain`) against the same plus `checksum_folder`
  (each file hashed after it is written, from the page cache, as each rank does for its own files);
- verify: `integrity.problem` on the written checkpoint (what a resume, eval, export or convert reads first),
  with the page cache warm (right after the save; a cold read adds the disk's read time, as the load itself does).

Also the single-core speed of hashlib's sha256 and blake2b (why sha256). `--dry-run`: 10 MB, one repeat.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench.common import machine, median, print_machine, save

TENSOR = 16 * 2**20  # float32 elements: 64 MB


def add_arguments(p) -> None:
    p.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (weights + 2 AdamW moments)")
    p.add_argument("--repeats", type=int, default=3, help="timed saves per arm: the median is reported")
    p.add_argument("--dir", default=None, help="where to write (default: a temp folder in the working dir)")
    p.add_argument("--dry-run", action="store_true", help="10 MB, one repeat: a smoke test, not a figure")


def state(gb: float) -> dict:
    """A Lightning-shaped checkpoint of `gb` GB: a third weights, two thirds AdamW moments, keyed by name."""
    elements = max(int(gb * 1e9 / 4 / 3), 1024)
    sizes = [TENSOR] * (elements // TENSOR) + ([elements % TENSOR] if elements % TENSOR else [])
    weights = {f"w{i}": torch.rand(n) for i, n in enumerate(sizes)}
    moments = {
        k: {"exp_avg": torch.rand_like(v), "exp_avg_sq": torch.rand_like(v)} for k, v in weights.items()
    }
    return {"state_dict": weights, "optimizer_0": {"state": moments}, "global_step": 1}


def plain_file(ckpt: dict, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def dcp_save(ckpt: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "saving in a single process": it is
        dcp.save(ckpt, checkpoint_id=str(path), no_dist=True)


def arms() -> dict:
    from parallama.checkpoint.atomic import save_file
    from parallama.checkpoint.integrity import checksum_folder

    def checksummed_dcp(ckpt: dict, path: Path) -> None:
        dcp_save(ckpt, path)
        checksum_folder(path)

    return {
        "file": {"plain": plain_file, "checksummed": save_file},
        "dcp": {"plain": dcp_save, "checksummed": checksummed_dcp},
    }


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def verify_seconds(path: Path) -> float:
    from parallama.checkpoint import integrity

    integrity._problem.cache_clear()  # timed as a fresh process reads it
    start = time.perf_counter()
    assert integrity.problem(path) is None, path
    return time.perf_counter() - start


def hash_speed(gb: float) -> dict:
    """GB/s of one core: the digest of a buffer in memory."""
    buffer = os.urandom(min(int(gb * 1e9), 256 * 2**20))
    speed = {}
    for name in ("sha256", "blake2b"):
        seconds = timed(hashlib.new(name).update, buffer)
        speed[name] = round(len(buffer) / seconds / 1e9, 3)
    return speed


def run(args) -> None:
    gb, repeats = (0.01, 1) if args.dry_run else (args.gb, args.repeats)
    info = machine()
    print_machine(info)
    ckpt = state(gb)
    size = sum(t.numel() * 4 for t in ckpt["state_dict"].values()) * 3 / 1e9
    root = Path(tempfile.mkdtemp(prefix="bench-checksum-", dir=args.dir or "."))
    seconds = {fmt: {arm: [] for arm in ("plain", "checksummed", "verify")} for fmt in ("file", "dcp")}
    try:
        for fmt, writers in arms().items():  # untimed, tiny: the first call's imports and set-up
            for arm, write in writers.items():
                write(state(0.001), root / f"warmup-{fmt}-{arm}")
        for _ in range(repeats):
            for fmt, writers in arms().items():
                for arm, write in writers.items():
                    path = root / f"{fmt}-{arm}.ckpt"
                    seconds[fmt][arm].append(timed(write, ckpt, path))
                    if arm == "checksummed":
                        seconds[fmt]["verify"].append(verify_seconds(path))
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"gb": round(size, 3), "repeats": repeats, "seconds": seconds, "hash_gb_per_s": hash_speed(gb)}
    per_gb = {}
    print(f"\ncheckpoint of {size:.2f} GB, median of {repeats} rounds; seconds (seconds per GB)")
    print(f"{'format':<8}{'plain save':>18}{'checksummed save':>22}{'hashing adds':>18}{'verify':>18}")
    for fmt, arm in seconds.items():
        adds = median(s - p for s, p in zip(arm["checksummed"], arm["plain"]))  # per round: drift cancels
        cells = [median(arm["plain"]), median(arm["checksummed"]), adds, median(arm["verify"])]
        per_gb[fmt] = dict(
            zip(("save", "checksummed_save", "hashing_adds", "verify"), (round(c / size, 3) for c in cells))
        )
        widths = (18, 22, 18, 18)
        print(f"{fmt:<8}" + "".join(f"{f'{c:.2f} ({c / size:.2f}/GB)':>{w}}" for c, w in zip(cells, widths)))
    result["seconds_per_gb"] = per_gb
    speed = result["hash_gb_per_s"]
    print(f"one core hashes {speed['sha256']} GB/s with sha256, {speed['blake2b']} GB/s with blake2b")
    save(args.out, "checksum", info, result)
