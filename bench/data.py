"""`data`: tokenizer and data-loader throughput, and the loader's headroom over what a GPU consumes; building
the token cache (`parallama-prepare`): its throughput against the tokenizer alone, and its peak memory.

Tokenizers encode the corpus with `encode_batch` (batched, as the cache builder calls them); the loader is
`TextDataModule.train_dataloader()` reading the token memmap cache, packed and padded, with 0 and 2 workers.
Headroom = loader tokens/s / tokens/s the 180M model consumes at 45% MFU on one H100 (bf16 dense peak
989 TFLOP/s) at seq_len 512. Each figure is the median of `--repeats` timed passes after untimed warmup.
Document masking (`data.document_mask`): the packed loader with it off and on, alternating round by round, and
the tiny model's CPU forward+backward with SDPA's is_causal vs SDPA with the block-diagonal mask.

Prepare: see `prepare_throughput` and `prepare_memory`.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

from bench.common import datamodule, machine, median, preset, print_machine, quiet, save

H100_BF16_PEAK = 989e12
GOAL_MFU = 0.45
GOAL_HEADROOM = 10.0


def goal_tokens_per_s() -> tuple[float, float]:
    """(tokens/s, FLOPs/token) of llama_180m at seq 512 running at GOAL_MFU of an H100's bf16 peak."""
    from parallama.models.llama.config import LlamaConfig

    fpt = LlamaConfig(**preset("llama_180m", 0)).flops_per_token(512)
    return GOAL_MFU * H100_BF16_PEAK / fpt, fpt


def tokenizer_rate(tok, docs: list[str], repeats: int) -> float:
    tok.encode_batch(docs[:8], add_special_tokens=False)  # warm up the thread pool
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
        rates.append(n / (time.perf_counter() - t0))
    return median(rates)


def _batches(loader):
    """Batches forever, epoch after epoch, as a training run draws them."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def loader_rate(args, packing: bool, workers: int) -> float:
    dm = datamodule(
        args.cache_dir, args.seq_len, args.batch, workers, packing, args.corpus, args.max_documents
    )
    batches = _batches(dm.train_dataloader())
    tokens = args.batches * args.batch * args.seq_len
    rates = []
    for _ in islice(batches, args.warmup_batches):  # worker start-up and first reads are not throughput
        pass
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in islice(batches, args.batches):
            pass
        rates.append(tokens / (time.perf_counter() - t0))
    batches.close()  # ends the iterator, and with it the workers
    return median(rates)


def run(args) -> dict:
    from parallama.data import byte_level, embedded, train_bpe

    quiet()
    info = machine()
    print_machine(info)
    docs = list(embedded(args.corpus, args.max_documents))
    print(f"# data: corpus={args.corpus} ({len(docs)} docs, {sum(map(len, docs)) / 1e6:.2f} M chars)")
    t0 = time.perf_counter()
    bpe = train_bpe(docs, vocab_size=args.bpe_vocab)
    print(f"# BPE (vocab {args.bpe_vocab}) trained in {time.perf_counter() - t0:.1f} s")
    results = {"config": vars(args), "tokenizer_tokens_per_s": {}, "loader_tokens_per_s": {}}
    print(f"\n{'tokenizer (encode_batch)':<28} {'tokens/s':>12}")
    for name, tok in (("byte_level", byte_level()), (f"bpe_{args.bpe_vocab}", bpe)):
        rate = tokenizer_rate(tok, docs, args.repeats)
        results["tokenizer_tokens_per_s"][name] = rate
        print(f"{name:<28} {rate:>12,.0f}")

    goal, fpt = goal_tokens_per_s()
    results["goal"] = {
        "tokens_per_s": goal,
        "flops_per_token": fpt,
        "mfu": GOAL_MFU,
        "peak_flops": H100_BF16_PEAK,
    }
    print(
        f"\ngoal: llama_180m at seq 512 = {fpt / 1e6:.1f} MFLOP/token; {GOAL_MFU:.0%} MFU of an H100 "
        f"({H100_BF16_PEAK / 1e12:.0f} TFLOP/s bf16) = {goal:,.0f} tokens/s per GPU; headroom goal >= {GOAL_HEADROOM:g}x"
    )
    print(f"loader: batch {args.batch} x seq_len {args.seq_len}")
    print(f"{'loader':<28} {'tokens/s':>12} {'headroom':>9}")
    for packing in (True, False):
        for workers in (0, 2):
            name = f"{'packed' if packing else 'padded'}, num_workers={workers}"
            rate = loader_rate(args, packing, workers)
            results["loader_tokens_per_s"][name] = rate
            print(f"{name:<28} {rate:>12,.0f} {rate / goal:>8.1f}x")
    worst = min(results["loader_tokens_per_s"].values()) / goal
    met = "met" if worst >= GOAL_HEADROOM else "NOT met"
    print(f"\nworst headroom {worst:.1f}x: goal >= {GOAL_HEADROOM:g}x {met} on this CPU")
    results["document_mask"] = document_mask_costs(args, goal)
    results["prepare"] = prepare_throughput(args, docs, bpe)
    results["prepare_peak_rss_mb"] = prepare_memory(args, docs, bpe)
    save(args.out, "data", info, results)
    return results


def _timed_pass(batches, n: int) -> float:
    t0 = time.perf_counter()
    for _ in islice(batches, n):
        pass
    return time.perf_counter() - t0


def _packed(args, workers: int, document_mask: bool):
    return datamodule(
        args.cache_dir,
        args.seq_len,
        args.batch,
        workers,
        corpus=args.corpus,
        max_documents=args.max_documents,
        document_mask=document_mask,
    )


def document_mask_costs(args, goal: float) -> dict:
    """The packed loader with `document_mask` off and on (positions and document ids computed per item), and
    what the mask costs the model on CPU. The arms alternate round by round; ratios are medians of rounds."""
    print(f"\ndocument masking: packed loader, batch {args.batch} x seq_len {args.seq_len}")
    print(
        f"{'loader':<28} {'off tokens/s':>13} {'on tokens/s':>13} {'on/off':>7} {'headroom on':>12}  (rounds)"
    )
    tokens = args.batches * args.batch * args.seq_len
    loaders = {}
    for workers in (0, 2):
        arms = {mask: _batches(_packed(args, workers, mask).train_dataloader()) for mask in (False, True)}
        for batches in arms.values():
            _timed_pass(batches, args.warmup_batches)
        times = {False: [], True: []}
        for _ in range(args.repeats):
            for mask, batches in arms.items():
                times[mask].append(_timed_pass(batches, args.batches))
        for batches in arms.values():
            batches.close()
        off, on = (tokens / median(times[m]) for m in (False, True))
        rounds = [t_off / t_on for t_off, t_on in zip(times[False], times[True])]
        name = f"packed, num_workers={workers}"
        loaders[name] = {"off": off, "on": on, "on_over_off": median(rounds), "rounds": rounds}
        loaders[name]["headroom_on"] = on / goal
        per_round = ", ".join(f"{r:.2f}" for r in rounds)
        print(
            f"{name:<28} {off:>13,.0f} {on:>13,.0f} {median(rounds):>7.3f} {on / goal:>11.1f}x  ({per_round})"
        )
    return {"loader_tokens_per_s": loaders, "model_cpu": mask_model_cost(args)}


def mask_model_cost(args) -> dict:
    """Steps/s of the `tiny` preset's forward+backward on CPU on one packed batch: SDPA is_causal (no document
    ids) vs SDPA with the (B, 1, T, T) block-diagonal mask and restarting positions."""
    import torch

    from parallama.models.llama.config import LlamaConfig
    from parallama.models.llama.model import Llama

    dm = _packed(args, workers=0, document_mask=True)
    batch = next(iter(dm.train_dataloader()))
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**preset("tiny", dm.vocab_size)))
    arms = {
        "is_causal": {},
        "document mask": {k: batch[k] for k in ("position_ids", "document_ids")},
    }

    def steps(kwargs: dict, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            model(batch["input_ids"], **kwargs).float().logsumexp(-1).mean().backward()
            model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for kwargs in arms.values():
        steps(kwargs, 1)  # warmup
    times = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, kwargs in arms.items():
            times[name].append(steps(kwargs, args.model_steps))
    rates = {name: args.model_steps / median(t) for name, t in times.items()}
    rounds = [a / b for a, b in zip(times["is_causal"], times["document mask"])]
    docs = (batch["document_ids"][:, -1] + 1).tolist()
    print(
        f"model (tiny, CPU, forward+backward, {args.batch} x {args.seq_len}, documents per row {docs}): "
        f"is_causal {rates['is_causal']:.2f} steps/s, document mask {rates['document mask']:.2f} steps/s, "
        f"mask/is_causal {median(rounds):.3f} (rounds {', '.join(f'{r:.2f}' for r in rounds)})"
    )
    return {
        "steps_per_s": rates,
        "mask_over_is_causal": median(rounds),
        "rounds": rounds,
        "documents_per_row": docs,
    }


PREPARE_GOALS = {"1 process / encode_batch": 0.8, "2 processes / 1 process": 1.8}
RSS_GOAL_MB = 1024


def _encode_rate(tok, docs: list[str], threads: bool, times: int) -> float:
    """encode_batch over the corpus, `times` over (one call per copy), with or without the tokenizer's threads."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"
    try:
        start = time.perf_counter()
        n = sum(len(e.ids) for _ in range(times) for e in tok.encode_batch(docs, add_special_tokens=False))
        return n / (time.perf_counter() - start)
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM")
        if before is not None:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def _prepare_rate(folder: str, num_proc: int, threads: bool, args) -> float:
    """A whole build (parts, index) from nothing in `bench/prepare_run.py`'s process: tokens / seconds."""
    with tempfile.TemporaryDirectory(dir=folder) as cache:
        cmd = [sys.executable, "-m", "bench.prepare_run", f"{folder}/docs.pkl", f"{folder}/tok.json", cache]
        cmd += ["--num-proc", str(num_proc), "--part-chars", str(args.part_chars)]
        cmd += ["--times", str(args.prepare_times), *(["--threads"] if threads else [])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
    result = json.loads(out.stdout.splitlines()[-1])
    return result["tokens"] / result["seconds"]


def prepare_throughput(args, docs: list[str], tok) -> dict:
    """Building the cache vs the tokenizer alone, on the same documents (the corpus `--prepare-times` over), in
    alternating rounds. `encode_batch` is one call per copy of the in-memory corpus; a build is the whole of
    `TokenCache.build_or_open` (documents cut into parts, encoded, parts written, then split into shards and the
    index), timed inside its own process (process start not counted; its workers' start is). Single-threaded
    tokenizers throughout, so that 1 -> 2 processes measures the processes; plus, for reference, the path training
    takes (1 process, the tokenizer's threads on) against encode_batch with threads."""
    ratios = {
        "1 process / encode_batch": ("prepare, 1 process", "encode_batch, 1 thread"),
        "2 processes / 1 process": ("prepare, 2 processes", "prepare, 1 process"),
        "in training / encode_batch, threads": (
            "prepare in training (1 process, threads)",
            "encode_batch, threads",
        ),
    }
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as folder:
        arms = {
            "encode_batch, 1 thread": lambda: _encode_rate(tok, docs, False, args.prepare_times),
            "prepare, 1 process": lambda: _prepare_rate(folder, 1, False, args),
            "prepare, 2 processes": lambda: _prepare_rate(folder, 2, False, args),
            "encode_batch, threads": lambda: _encode_rate(tok, docs, True, args.prepare_times),
            "prepare in training (1 process, threads)": lambda: _prepare_rate(folder, 1, True, args),
        }
        rates: dict[str, list[float]] = {name: [] for name in arms}
        Path(folder, "docs.pkl").write_bytes(pickle.dumps(docs))
        tok.save(f"{folder}/tok.json")
        for _ in range(args.repeats):
            for name, arm in arms.items():
                rates[name].append(arm())
    per_round = {r: [x / y for x, y in zip(rates[a], rates[b])] for r, (a, b) in ratios.items()}
    chars = args.prepare_times * sum(map(len, docs)) / 1e6
    print(
        f"\nprepare (BPE-{tok.get_vocab_size()}, {chars:.1f} M chars, part_chars {args.part_chars:,}): tokens/s"
    )
    for name, values in rates.items():
        print(f"{name:<42} {median(values):>12,.0f}")
    for name, values in per_round.items():
        goal = PREPARE_GOALS.get(name)
        verdict = f"goal >= {goal:g}: {'met' if median(values) >= goal else 'NOT met'}" if goal else ""
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:<42} {median(values):>11.2f}x  (rounds {rounds}) {verdict}")
    return {
        "tokens_per_s": {k: median(v) for k, v in rates.items()},
        "ratios": {k: median(v) for k, v in per_round.items()},
        "ratios_per_round": per_round,
        "goals": PREPARE_GOALS,
    }


def _peak_rss(cmd: list[str]) -> tuple[float, float]:
    """(peak of the summed RSS of the process and its descendants, peak RSS of any one of them) in MB, sampled
    every 20 ms. Summed RSS counts shared pages (libraries) once per process: an upper bound."""
    import psutil

    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        root, tree, single = psutil.Process(proc.pid), 0, 0
        while proc.poll() is None:
            try:
                sizes = [p.memory_info().rss for p in [root, *root.children(recursive=True)]]
            except psutil.Error:  # a process ended while being read
                continue
            tree, single = max(tree, sum(sizes)), max(single, *sizes)
            time.sleep(0.02)
        if proc.returncode:
            log.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed: {log.read()[-2000:]}")
    return tree / 2**20, single / 2**20


def prepare_memory(args, docs: list[str], tok) -> dict:
    """Peak memory of `python -m parallama.cli.prepare` (2 processes) over 1x, 4x, 16x the corpus: jsonl files read by
    `data/source=files` (k links to one file of the corpus), a tokenizer given as a file (tokenizer training has
    its own cap, `tokenizer.train_documents`)."""
    results = {}
    print(f"\nprepare peak RSS (MB), 2 processes; goal: flat, < {RSS_GOAL_MB} MB")
    print(f"{'corpus':<10} {'tokens':>12} {'process tree':>13} {'largest process':>16}")
    with tempfile.TemporaryDirectory(prefix="bench-prepare-rss-") as folder:
        with open(f"{folder}/corpus.jsonl", "w") as f:
            f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
        tok.save(f"{folder}/tok.json")
        for k in args.rss_multiples:
            os.makedirs(data := f"{folder}/x{k}")
            for i in range(k):
                os.symlink(f"{folder}/corpus.jsonl", f"{data}/part{i:03d}.jsonl")
            cmd = [
                sys.executable,
                "-m",
                "parallama.cli.prepare",
                "data/source=files",
                f"data.source.paths={data}/*.jsonl",
            ]
            cmd += ["tokenizer=pretrained", f"tokenizer.name_or_path={folder}/tok.json", "prepare.num_proc=2"]
            cmd += [f"prepare.part_chars={args.part_chars}", f"paths.cache_dir={folder}/cache{k}"]
            cmd += [f"hydra.run.dir={folder}/run{k}"]
            tree, single = _peak_rss(cmd)
            (index,) = Path(folder, f"cache{k}").glob("*/index.json")
            tokens = sum(json.loads(index.read_text())["n_tokens"].values())
            results[f"{k}x"] = {"tokens": tokens, "tree": tree, "largest_process": single}
            print(f"{f'{k}x':<10} {tokens:>12,} {tree:>13,.0f} {single:>16,.0f}")
    worst = max(r["tree"] for r in results.values())
    print(
        f"largest peak {worst:,.0f} MB: goal < {RSS_GOAL_MB} MB {'met' if worst < RSS_GOAL_MB else 'NOT met'}"
    )
    return results


def add_arguments(p) -> None:
    p.add_argument(
        "--corpus", default="code", choices=["prose", "code"], help="embedded corpus (code: 734 docs)"
    )
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--bpe-vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="per-device micro-batch (the article's 64 / 8 GPUs)")
    p.add_argument("--batches", type=int, default=200, help="batches per timed pass")
    p.add_argument("--warmup-batches", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--model-steps", type=int, default=5, help="forward+backward steps per timed pass (mask cost)"
    )
    p.add_argument(
        "--part-chars", type=int, default=1_000_000, help="prepare.part_chars of the prepare figures"
    )
    p.add_argument(
        "--prepare-times", type=int, default=4, help="prepare throughput on the corpus N times over"
    )
    p.add_argument(
        "--rss-multiples",
        type=lambda s: [int(k) for k in s.split(",")],
        default=[1, 4, 16],
        help="corpus sizes (times the corpus) whose prepare peak RSS is measured",
    )
