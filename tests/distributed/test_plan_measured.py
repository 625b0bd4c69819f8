"""The planner's model-state bytes per rank against two real gloo processes (DDP, ZeRO-1, FSDP2)."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.parallel.plan import estimate

SMALL = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _local_bytes(tensors) -> int:
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure_rank(rank: int, world: int, init: str, out_dir: str) -> None:
    """One AdamW step under DDP, DDP + ZeroRedundancyOptimizer and FSDP2; bytes of this rank's states."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ids = torch.randint(0, SMALL.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    result = {}
    for name in ("ddp", "ddp_sharded", "fsdp"):
        torch.manual_seed(0)
        model = Llama(SMALL)
        if name == "fsdp":
            for block in model.layers.values():
                fully_shard(block)
            fully_shard(model)
            net, opt = model, torch.optim.AdamW(model.parameters())
        else:
            net = DDP(model, gradient_as_bucket_view=True)
            opt = torch.optim.AdamW(model.parameters())
            if name == "ddp_sharded":
                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
        F.cross_entropy(net(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
        state = (opt.optim if name == "ddp_sharded" else opt).state.values()
        result[name] = {
            "params": _local_bytes(model.parameters()),
            "grads": _local_bytes(p.grad for p in model.parameters()),
            "optim": _local_bytes(t for s in state for k, t in s.items() if k != "step"),
        }
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_model_state_bytes_per_rank_match_two_gloo_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(_measure_rank, args=(2, f"file://{tmp_path}/pg", str(tmp_path)), nprocs=2)
    expected = estimate(
        SMALL, world_size=2, seq_len=64, micro_batch=2, precision="32-true", activation_checkpointing=False
    )
    for rank in range(2):
        measured = json.loads((tmp_path / f"{rank}.json").read_text())
        for name, parts in measured.items():
            for part, value in parts.items():
                assert value == pytest.approx(getattr(expected[name], part), rel=0.05), (rank, name, part)
