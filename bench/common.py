"""Helpers shared by the benchmarks: the machine description, presets, the tiny corpus, results."""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import socket
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def quiet() -> None:
    """Lightning's advice (few batches, no workers, ...) would drown the tables; errors still show."""
    import lightning  # noqa: F401  (its import sets its loggers to INFO)

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "parallama"):
        logging.getLogger(name).setLevel(logging.ERROR)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What absolute numbers mean nothing without."""
    info = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "command": " ".join([os.path.basename(sys.executable), "-m", "bench", *sys.argv[1:]]),
    }
    return info


def print_machine(info: dict) -> None:
    load = ", ".join(f"{x:.2f}" for x in info["load_average"])
    print(f"# {info['date']}  torch {info['torch']}  python {info['python']}")
    print(f"# cpu: {info['cpu']} ({info['cpu_count']} cores, torch threads {info['torch_threads']})")
    print(f"# gpu: {info['gpu'] or 'none'}   load average (1/5/15 min): {load}")


def preset(name: str, vocab_size: int) -> dict:
    """A conf/model preset as a dict; `vocab_size: null` follows the tokenizer as parallama-train does."""
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"), resolve=True)
    cfg.pop("family")  # the benchmarks build the Llama itself
    if cfg["vocab_size"] is None:
        cfg["vocab_size"] = -(-vocab_size // 64) * 64
    return cfg


def datamodule(
    cache_dir,
    seq_len,
    batch_size,
    num_workers=0,
    packing=True,
    corpus="prose",
    max_documents=None,
    document_mask=False,
):
    """parallama's data path on an embedded corpus with the byte tokenizer (offline; the cache is built once)."""
    from parallama.data import TextDataModule, byte_level, embedded

    dm = TextDataModule(
        source=partial(embedded, corpus=corpus, max_documents=max_documents),
        tokenizer=byte_level,
        seq_len=seq_len,
        batch_size=batch_size,
        packing=packing,
        document_mask=document_mask,
        num_workers=num_workers,
        cache_dir=cache_dir,
    )
    dm.setup()
    return dm


def sync(device: torch.device) -> None:
    """CUDA runs ahead of Python: wait for it before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs) -> float:
    return statistics.median(xs)


def save(out: str | None, name: str, info: dict, results: dict) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"benchmark": name, "machine": info, **results}, indent=2) + "\n")
        print(f"# wrote {out}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, world: int, *args) -> list:
    """Run `target(rank, world, port, *args, queue)` in `world` spawned processes (gloo on `port`); what the ranks
    put on the queue. Spawn, not fork: a fork of this multi-threaded process hung now and then (locks held by
    other threads). The queue is read while they run: a rank that puts more than the pipe holds would otherwise
    wait on its put while this waited on its exit."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.SimpleQueue(), free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    while any(p.is_alive() for p in procs) or not queue.empty():
        while not queue.empty():
            results.append(queue.get())
        time.sleep(0.05)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return results
