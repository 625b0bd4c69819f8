"""Muon's orthogonalization in batches (training/muon.py): torch.optim.Muon's `_zeropower_via_newtonschulz`, op
for op, on a stack of same-shape matrices. Each matrix is normalized by its own norm, so a matrix's result does
not depend on the others in its batch; a tall matrix is taken as its transpose, as torch's does, so Llama's
gate/up projections (8192 x 2048) share a batch with its down projections (2048 x 8192).

On CUDA the iteration is one `torch.compile`d function (its GEMMs are cuBLAS's either way; compiling fuses the
cast, the normalization and the scalings between them); elsewhere it runs eager, which keeps the CPU tests fast.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def newton_schulz(
    batch: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype
) -> Tensor:
    """`batch` (n, rows, cols), rows <= cols, each matrix orthogonalized in `dtype` (torch's: bf16)."""
    a, b, c = coefficients
    x = batch.to(dtype)
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


@functools.cache
def compiled_newton_schulz():
    """`newton_schulz` through torch.compile, built on first use (importing the compiler costs a CLI start). Its
    sizes are dynamic: one graph serves every shape and every rank's share (a batch of one matrix gets a second)."""
    return torch.compile(newton_schulz, fullgraph=True, dynamic=True)


def orthogonalize(updates: list[Tensor], coefficients, steps: int, eps: float, dtype) -> list[Tensor]:
    """Each 2-D update orthogonalized, in `dtype`; those of one shape (tall ones transposed) and device in one batch.
    The results are views of their batch's."""
    batches: dict[tuple, list[int]] = {}
    for i, update in enumerate(updates):
        batches.setdefault((_wide(update).shape, update.device), []).append(i)
    results: list[Tensor] = [None] * len(updates)
    for (_, device), indices in batches.items():
        kernel = compiled_newton_schulz() if device.type == "cuda" else newton_schulz
        batch = kernel(torch.stack([_wide(updates[i]) for i in indices]), coefficients, steps, eps, dtype)
        for i, result in zip(indices, batch):
            results[i] = result.mT if _tall(updates[i]) else result
    return results


def _tall(matrix: Tensor) -> bool:
    return matrix.size(0) > matrix.size(1)


def _wide(matrix: Tensor) -> Tensor:
    return matrix.mT if _tall(matrix) else matrix


def iteration_flops(rows: int, cols: int, steps: int) -> int:
    """The iteration's FLOPs on one rows x cols matrix: per step X X^T, b A + c A A and a X + B X."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)
