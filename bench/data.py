"""`data`: tokenizer and data-loader throughput, and the loader's headroom over what a GPU consumes.

Tokenizers encode the corpus with `encode_batch` (batched, as the cache builder calls them); the loader is
`TextDataModule.train_dataloader()` reading the token memmap cache, packed and padded, with 0 and 2 workers.
Headroom = loader tokens/s / tokens/s the 180M model consumes at 45% MFU on one H100 (bf16 dense peak
989 TFLOP/s) at seq_len 512. Each figure is the median of `--repeats` timed passes after untimed warmup.
"""

from __future__ import annotations

import time
from itertools import islice

from bench.common import datamodule, machine, median, preset, print_machine, quiet, save

H100_BF16_PEAK = 989e12
GOAL_MFU = 0.45
GOAL_HEADROOM = 10.0


def goal_tokens_per_s() -> tuple[float, float]:
    """(tokens/s, FLOPs/token) of llama_180m at seq 512 running at GOAL_MFU of an H100's bf16 peak."""
    from parallama.model import LlamaConfig

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
    save(args.out, "data", info, results)
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
