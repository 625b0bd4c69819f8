"""ParallamaLM.generate_until with its requests split over 2 ranks, as lm-eval splits them (rank r: requests r,
r + 2, ...), on an FSDP2-sharded model (gloo, CPU), against one process on the same weights.

A sharded forward pass is collective, so both ranks must run as many passes although their shares differ: rank 0
has one batch more, and paired batches ask for different numbers of tokens (max_gen_toks 9 against 3, one way and
the other). Each text must be the one process's, cut to its own max_gen_toks and `until`; passes that do not pair
up end in a gloo error or a hang (the deadline). The embedded tasks only score log-likelihoods, so the in-loop
tests (test_downstream_eval_strategies.py) never reach this path.
"""

import json
import time

import pytest
import torch
from conftest import SMALL_LLAMA
from lm_eval.api.instance import Instance

from parallama.evaluation import tasks as embedded
from parallama.evaluation.lm import ParallamaLM
from parallama.models import model_spec
from parallama.tokenizer import byte_level

pytestmark = pytest.mark.multiprocess

WORLD = 2


def build():
    torch.manual_seed(0)
    spec = model_spec(SMALL_LLAMA)
    return spec.model(spec.build_config(SMALL_LLAMA)).eval()


def requests() -> list[Instance]:
    """7 prompts of different lengths (one batch each); max_gen_toks 9 for requests 0, 3, 6, else 3."""
    docs = embedded.cloze_docs(embedded.paragraphs())[:7]
    return [
        Instance(
            "generate_until",
            {},
            (
                d["context"][: 10 + 3 * i],
                {"until": ["e"] if i % 2 else [], "max_gen_toks": 9 if i % 3 == 0 else 3},
            ),
            i,
        )
        for i, d in enumerate(docs)
    ]


def _rank(rank: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallama.distributed.blocks import apply_fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    model = build()
    apply_fsdp(model, init_device_mesh("cpu", (WORLD,)))
    lm = ParallamaLM(model, byte_level(), batch_size=4, dp_ranks=list(range(WORLD)))
    texts = lm.generate_until(requests()[rank::WORLD])
    with open(f"{out_dir}/texts{rank}.json", "w") as f:
        json.dump(texts, f)
    dist.destroy_process_group()


def test_sharded_generation_equals_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ranks = torch.multiprocessing.spawn(
        _rank, args=(f"file://{tmp_path}/pg", str(tmp_path)), nprocs=WORLD, join=False
    )
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(
                "generate_until on 2 ranks did not finish in 180 s (forward passes that do not pair up)"
            )
    reqs = requests()
    one = ParallamaLM(build(), byte_level(), batch_size=4).generate_until(reqs)
    for rank in range(WORLD):
        texts = json.loads((tmp_path / f"texts{rank}.json").read_text())
        assert texts == one[rank::WORLD], rank
    assert len(set(one)) == len(one) and all(one)  # real, distinct continuations
    assert all("e" not in text for text, r in zip(one, reqs) if r.args[1]["until"])
