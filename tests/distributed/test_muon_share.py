"""optimizer=muon shares its orthogonalizations (training/muon_share.py): on 4 ranks (gloo), each rank runs the
Newton-Schulz iteration on its share of the matrices only, and every rank ends with the weights one process
computes, under each layout a matrix can have: whole replicas (ddp), Shard(0) on one mesh dimension (fsdp, also
with an empty shard), (Replicate, Shard(0)) (HSDP) and (Shard(0), Shard(0)) / (Shard(0), Shard(1)) on a 2 x 2
mesh (FSDP x TP's shapes; FSDP2's own placements over TP train in test_recipe.py's fsdp_tp); ddp, HSDP and
FSDP x TP also with `ns_method=gram` (its costs balance the shares). The counts are the
matrices each rank's iteration received; whole matrices that are not replicas (ZeroRedundancyOptimizer's per-rank
optimizers: `share_replicas=false`) are all orthogonalized by their rank. Every layout through parallama-train:
tests/distributed/test_recipe.py."""

from __future__ import annotations

import json

import pytest
import torch

WORLD, STEPS = 4, 2
# tall and wide ones of one wide shape, a square one and one whose 6 rows leave a rank of 4 an empty shard
SHAPES = [(12, 8), (12, 8), (8, 12), (8, 12), (8, 12), (16, 16), (6, 10)]
LAYOUTS = {  # name: (mesh shape, placements of the matrices, alternating; None: whole tensors)
    "ddp": ((WORLD,), None),
    "not_replicas": ((WORLD,), None),
    "fsdp": ((WORLD,), [("shard0",)]),
    "hsdp": ((2, 2), [("replicate", "shard0")]),
    "fsdp_tp": ((2, 2), [("shard0", "shard0"), ("shard0", "shard1")]),
    "fsdp_bf16": ((WORLD,), [("shard0",)]),
    # ns_method=gram on whole replicas, HSDP and FSDP x TP
    "ddp_gram": ((WORLD,), None),
    "hsdp_gram": ((2, 2), [("replicate", "shard0")]),
    "fsdp_tp_gram": ((2, 2), [("shard0", "shard0"), ("shard0", "shard1")]),
}


def _placements(names):
    from torch.distributed.tensor import Replicate, Shard

    return [{"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1)}[n] for n in names]


def _optimizer(params, layout: str, *, share_replicas: bool):
    from parallama.training.muon import MuonAdamW

    return MuonAdamW(
        [{"params": params, "muon": True}],
        lr=0.02,
        ns_dtype="bfloat16" if layout.endswith("bf16") else "float32",
        ns_method="gram" if layout.endswith("gram") else "standard",
        share_replicas=share_replicas,
    )


def _rank(rank: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    import parallama.training.newton_schulz as newton_schulz

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    counted = [0]

    def counting(iterate):
        def counted_iteration(batch, *args):
            counted[0] += batch.shape[0]
            return iterate(batch, *args)

        return counted_iteration

    newton_schulz.newton_schulz = counting(newton_schulz.newton_schulz)
    newton_schulz.gram_newton_schulz = counting(newton_schulz.gram_newton_schulz)

    def local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    out = {}
    for layout, (mesh_shape, placements) in LAYOUTS.items():
        generator = torch.Generator().manual_seed(0)
        start = [torch.randn(shape, generator=generator) for shape in SHAPES]
        grads = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(STEPS)]

        # one process: whole matrices, not shared (no collective)
        reference = [torch.nn.Parameter(w.clone()) for w in start]
        optimizer = _optimizer(reference, layout, share_replicas=False)
        for step in range(STEPS):
            for p, g in zip(reference, grads[step]):
                p.grad = g.clone()
            optimizer.step()

        mesh = init_device_mesh("cpu", mesh_shape)
        layouts = [
            _placements(placements[i % len(placements)]) if placements else None for i in range(len(SHAPES))
        ]

        def place(tensor, layout_of, mesh=mesh):  # every rank holds the whole: its piece, no collective
            if layout_of is None:
                return tensor.clone()
            return distribute_tensor(tensor, mesh, layout_of, src_data_rank=None)

        params = [torch.nn.Parameter(place(w, lay)) for w, lay in zip(start, layouts)]
        optimizer = _optimizer(params, layout, share_replicas=layout != "not_replicas")
        counted[0] = 0
        for step in range(STEPS):
            for p, g, lay in zip(params, grads[step], layouts):
                p.grad = place(g, lay)
            optimizer.step()
        difference = max(
            (local(p) - local(place(r.detach(), lay))).abs().max().item()
            for p, r, lay in zip(params, reference, layouts)
            if local(p).numel()  # an empty shard
        )
        out[layout] = {"orthogonalized": counted[0], "difference": difference}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("muon_share")
    torch.multiprocessing.spawn(_rank, args=(f"file://{tmp}/pg", str(tmp)), nprocs=WORLD)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "not_replicas"])
def test_each_rank_orthogonalizes_its_share_and_ends_as_one_process(ranks, layout):
    counts = [r[layout]["orthogonalized"] for r in ranks]
    assert sum(counts) == STEPS * len(SHAPES), counts  # each matrix once per step, by one rank
    assert max(counts) <= STEPS * 2, counts  # 7 matrices on 4 ranks: 1 or 2 each
    tolerance = 2e-3 if layout.endswith("bf16") else 1e-6
    assert max(r[layout]["difference"] for r in ranks) <= tolerance


@pytest.mark.multiprocess
def test_whole_matrices_that_are_not_replicas_are_all_orthogonalized_by_their_rank(ranks):
    assert [r["not_replicas"]["orthogonalized"] for r in ranks] == [STEPS * len(SHAPES)] * WORLD
    assert max(r["not_replicas"]["difference"] for r in ranks) == 0.0
