"""Each rank orthogonalizes its share of Muon's matrices (training/muon.py) whole, and gets back its piece of every
result: what torchtitan's DistMuon (Dion's Muon) does for FSDP2, here on any mesh.

The ranks that share a matrix are those that hold it: a DTensor's mesh (fsdp's Shard(0), tensor parallel's
Colwise/Rowwise, HSDP's (Replicate, Shard), FSDP x TP: any placements), or, for whole matrices, the replicas that
MuonAdamW is given (ddp's ranks, whose gradients are equal after its all-reduce). On each mesh `shares` gives every
rank a number of each set of alike matrices (one shape and layout), balanced by the iteration's cost. A set moves
as one DTensor: its local pieces stacked on a new last dimension in slots (rank r's matrices in the r-th block,
zeros in unused slots), redistributed to be sharded on that dimension, which brings each full update to its owner
(DTensor's all-to-all; from Replicate, a local slice). The owner orthogonalizes its matrices of every set in
batches (newton_schulz.py), and the reverse redistribution brings each rank its piece of every result (an
all-to-all; an all-gather where the parameter is replicated). The updates travel in the iteration's dtype (its
first operation is that cast: bf16 halves the bytes, the results are the same).

Under FSDP's cpu_offload the pieces live on the host and the mesh's collectives on its device: a set's stack moves
there and its results back (a path the CPU-only tests do not run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from parallama.training.newton_schulz import iteration_flops, orthogonalize


@dataclass
class Piece:
    """This rank's part of one matrix's update and the layouts of it and of its result."""

    local: Tensor
    mesh: object | None  # torch's DeviceMesh of the ranks that hold the matrix; None: this rank alone
    placements: tuple  # `local`'s on `mesh`
    result_placements: tuple  # the parameter's: where the result's pieces go
    shape: torch.Size  # the whole matrix's

    @property
    def alone(self) -> bool:
        return self.mesh is None or self.mesh.size() == 1


def shares(counts: list[int], costs: list[int], world: int) -> list[list[int]]:
    """How many matrices of each set each of `world` ranks orthogonalizes: an even split of the set, its remainder
    to the ranks with the least work so far (the costliest sets first), the same answer on every rank."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in counts]
    for s in sorted(range(len(counts)), key=lambda s: (-counts[s] * costs[s], s)):
        base, extra = divmod(counts[s], world)
        lightest = set(sorted(range(world), key=lambda r: (load[r], r))[:extra])
        out[s] = [base + (r in lightest) for r in range(world)]
        load = [load[r] + out[s][r] * costs[s] for r in range(world)]
    return out


def orthogonalized(
    pieces: list[Piece], coefficients, steps: int, eps: float, dtype, method: str
) -> list[Tensor]:
    """Each piece's update orthogonalized by `method` (newton_schulz.py), as this rank's piece of the result
    (`result_placements`), on the piece's device. Every rank of a mesh must call this with the same matrices in the
    same order."""
    alone = [i for i, piece in enumerate(pieces) if piece.alone]
    sets: dict[tuple, list[int]] = {}
    for i, piece in enumerate(pieces):
        if not piece.alone:
            key = (piece.mesh, piece.placements, piece.result_placements, piece.shape)
            sets.setdefault(key, []).append(i)
    by_mesh: dict = {}
    for key in sets:
        by_mesh.setdefault(key[0], []).append(key)
    exchanges = []
    for mesh, keys in by_mesh.items():
        counts = [len(sets[k]) for k in keys]
        costs = [iteration_flops(*k[3], steps, method) for k in keys]
        for key, share in zip(keys, shares(counts, costs, mesh.size())):
            exchanges.append((sets[key], Exchange([pieces[i] for i in sets[key]], share, dtype)))
    owned = [matrix for _, exchange in exchanges for matrix in exchange.send()]
    done = orthogonalize([pieces[i].local for i in alone] + owned, coefficients, steps, eps, dtype, method)
    results: list[Tensor] = [None] * len(pieces)
    for i, result in zip(alone, done):
        results[i] = result
    position = len(alone)
    for indices, exchange in exchanges:
        count = exchange.owned
        for i, result in zip(indices, exchange.receive(done[position : position + count])):
            results[i] = result
        position += count
    return results


class Exchange:
    """One set of alike matrices on one mesh: each rank's owned ones brought to it whole, and their results back."""

    def __init__(self, pieces: list[Piece], share: list[int], dtype) -> None:
        first = pieces[0]
        self.pieces, self.mesh, self.dtype = pieces, first.mesh, dtype
        self.slots = max(share)  # per rank
        rank = _flat_rank(self.mesh)
        self.owned = share[rank]
        self.slot_of = [r * self.slots + j for r in range(len(share)) for j in range(share[r])]
        self.shape = (*first.shape, self.slots * len(share))
        self.device = torch.device(self.mesh.device_type)
        self.batch_sharded = [Shard(2)] * self.mesh.ndim

    def send(self) -> list[Tensor]:
        """The whole matrices this rank owns."""
        local = [piece.local.to(self.dtype) for piece in self.pieces]
        in_slots = [torch.zeros_like(local[0])] * self.shape[-1]
        for slot, matrix in zip(self.slot_of, local):
            in_slots[slot] = matrix
        stacked = self._dtensor(torch.stack(in_slots, dim=-1), self.pieces[0].placements)
        owned = stacked.redistribute(self.mesh, self.batch_sharded).to_local()
        return list(owned[..., : self.owned].unbind(-1))

    def receive(self, results: list[Tensor]) -> list[Tensor]:
        """This rank's piece of each matrix's result."""
        local = torch.zeros((*self.shape[:2], self.slots), dtype=self.dtype, device=self.device)
        if results:
            local[..., : len(results)] = torch.stack(results, dim=-1)
        pieces = self._dtensor(local, self.batch_sharded)
        mine = pieces.redistribute(self.mesh, self.pieces[0].result_placements).to_local()
        return [mine[..., slot].to(piece.local.device) for slot, piece in zip(self.slot_of, self.pieces)]

    def _dtensor(self, local: Tensor, placements):
        rows, cols, slots = self.shape
        return DTensor.from_local(
            local.to(self.device),
            self.mesh,
            placements,
            shape=torch.Size(self.shape),
            stride=(cols * slots, slots, 1),
            run_check=False,
        )


def _flat_rank(mesh) -> int:
    """This rank's position in `mesh` read row-major: the block a dimension sharded on every mesh dimension gives it."""
    rank = 0
    for coordinate, size in zip(mesh.get_coordinate(), mesh.shape):
        rank = rank * size + coordinate
    return rank
