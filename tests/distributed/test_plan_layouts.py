"""parallama-plan's tensor-parallel division against what a tp rank really holds: the Llama's own TP plan
(models/llama/parallelize.py, with sequence parallel and the vocab-parallel head) on 2 gloo processes."""

import json
import os

import pytest
import torch

from parallama.distributed.dims import ParallelDims
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.parallel.layouts import stage_params

SMALL = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _rank(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    from parallama.models.llama.parallelize import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = ParallelDims(dp_shard=1, tp=world).build_mesh("cpu")
    model = Llama(SMALL)
    apply_tp(model, mesh["tp"], sequence_parallel=True, loss_parallel=True)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(local, f)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_a_tp_rank_holds_what_the_plan_says(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_rank, args=(2, f"file://{tmp_path}/pg", str(tmp_path)), nprocs=2)
    expected = stage_params(SMALL, ParallelDims(tp=2))
    for rank in range(2):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == expected
