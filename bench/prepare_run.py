"""Child process of `python -m bench data`: one timed token-cache build, as `parallama-prepare` runs it.

Its own process, so that the build's spawned workers import this small module as their main module (as they
import parallama.cli.prepare under the CLI), not the benchmark's torch. Prints {"seconds", "tokens"} as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time
from functools import partial


def corpus(path: str, times: int) -> list[str]:
    """The benchmark's documents (pickled by the parent), `times` over."""
    with open(path, "rb") as f:
        return pickle.load(f) * times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("docs", help="pickled list of documents")
    p.add_argument("tokenizer", help="tokenizer.json")
    p.add_argument("cache_dir", help="an empty folder: the build starts from nothing")
    p.add_argument("--num-proc", type=int, default=1)
    p.add_argument("--threads", action="store_true", help="leave the tokenizer's own thread pool on")
    p.add_argument("--times", type=int, default=1)
    p.add_argument("--part-chars", type=int, required=True)
    args = p.parse_args()
    if not args.threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    from parallama.data.cache import TokenCache

    cache = TokenCache(
        partial(corpus, args.docs, args.times), Tokenizer.from_file(args.tokenizer), args.cache_dir, 0.05, 42
    )
    start = time.perf_counter()
    entry = cache.build_or_open(num_proc=args.num_proc, part_chars=args.part_chars)
    print(json.dumps({"seconds": time.perf_counter() - start, "tokens": sum(entry.n_tokens.values())}))


if __name__ == "__main__":
    main()
