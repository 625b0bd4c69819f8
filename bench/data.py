"""`data`: tokenizer and data-loader throughput, and the loader's headroom over what a GPU consumes.

Tokenizers encode the corpus with `encode_batch` (batched, as the cache builder calls them); the loader is
`TextDataModule.train_dataloader()` reading the token memmap cache, packed and padded, with 0 and 2 workers.
Headroom = loader tokens/s / tokens/s the 180M model consumes at 45% MFU on one H100 (bf16 dense peak
989 TFLOP/s) at seq_len 512. Each figure is the median of `--repeats` timed passes after untimed warmup.
Document masking (`data.document_mask`): the packed loader with it off and on, alternating round by round, and
the tiny model's CPU forward+backward with SDPA's is_causal vs SDPA with the block-diagonal mask.
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
    results["document_mask"] = document_mask_costs(args, goal)
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

    from parallama.model import Llama, LlamaConfig

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
