"""Muon's orthogonalization in batches (training/muon.py): torch.optim.Muon's `_zeropower_via_newtonschulz`, op
for op, on a stack of same-shape matrices. Each matrix is normalized by its own norm, so a matrix's result does
not depend on the others in its batch; a tall matrix is taken as its transpose, as torch's does, so Llama's
gate/up projections (8192 x 2048) share a batch with its down projections (2048 x 8192).

`optimizer.ns_method: gram` (the default) runs the same polynomial iteration on the Gram matrix X X^T instead of X
(Gram Newton-Schulz, Dao AI Lab 2026; DeepSpeed 0.19.8's Muon default): on a rows x cols matrix with cols = 4 rows
(Llama's MLP, k and v projections) it costs 60 rows^3 FLOPs to the standard's 90 (`iteration_flops`); equal in
exact arithmetic, and restarted from X once (at `RESTART_AT`) as its authors do to keep half precision stable.
A matrix less than 1.5 times as wide as it is tall (a square one) takes the standard iteration either way.

On CUDA the iteration is one `torch.compile`d function (its GEMMs are cuBLAS's either way; compiling fuses the
cast, the normalization and the scalings between them); elsewhere it runs eager, which keeps the CPU tests fast.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

NS_METHODS = ("standard", "gram")
RESTART_AT = 2  # the Gram iteration's restart: X <- Q X and R <- X X^T anew before this step


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


def gram_newton_schulz(
    batch: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype
) -> Tensor:
    """`newton_schulz`'s result by way of the Gram matrix: X_{k+1} = P_k X_k with P_k = a I + b R_k + c R_k^2 and
    R_k = X_k X_k^T, so Q = P_k ... P_0 and R_{k+1} = P_k R_k P_k (P_k and R_k commute) are kept as rows x rows
    matrices, and X is touched only to form R, at the restart and in the final Q X. Cast and normalized as
    `newton_schulz` does (a shared matrix arrives cast: muon_share.py), so one process and a share agree."""
    a, b, c = coefficients
    x = batch.to(dtype)
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    r = torch.bmm(x, x.mT)
    q = None
    for step in range(steps):
        if step == RESTART_AT:
            x = torch.bmm(q, x)
            r, q = torch.bmm(x, x.mT), None
        z = torch.baddbmm(r, r, r, beta=b, alpha=c)  # P_k - a I
        if q is None:
            q = z + a * torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
        else:
            q = torch.baddbmm(q, z, q, beta=a)
        if step + 1 < steps and step + 1 != RESTART_AT:  # R_{k+1}: not after the last step or for the restart
            rz = torch.baddbmm(r, z, r, beta=a)  # P_k R_k
            r = torch.baddbmm(rz, z, rz, beta=a)  # P_k R_k P_k
    return torch.bmm(q, x) if q is not None else x


def iteration(method: str):
    """The iteration function of `method` ("standard" or "gram")."""
    return gram_newton_schulz if method == "gram" else newton_schulz


@functools.cache
def compiled_newton_schulz(method: str):
    """The `method`'s iteration through torch.compile, built on first use (importing the compiler costs a CLI
    start). Its sizes are dynamic: one graph serves every shape and every rank's share (a batch of one matrix gets a
    second)."""
    return torch.compile(iteration(method), fullgraph=True, dynamic=True)


def orthogonalize(
    updates: list[Tensor], coefficients, steps: int, eps: float, dtype, method: str
) -> list[Tensor]:
    """Each 2-D update orthogonalized, in `dtype`; those of one shape (tall ones transposed) and device in one batch,
    by `method` where it saves FLOPs (`uses_gram`), else by the standard iteration. The results are views of their
    batch's."""
    batches: dict[tuple, list[int]] = {}
    for i, update in enumerate(updates):
        batches.setdefault((_wide(update).shape, update.device), []).append(i)
    results: list[Tensor] = [None] * len(updates)
    for (shape, device), indices in batches.items():
        kind = "gram" if method == "gram" and uses_gram(*shape, steps) else "standard"
        kernel = compiled_newton_schulz(kind) if device.type == "cuda" else iteration(kind)
        batch = kernel(torch.stack([_wide(updates[i]) for i in indices]), coefficients, steps, eps, dtype)
        for i, result in zip(indices, batch):
            results[i] = result.mT if _tall(updates[i]) else result
    return results


def uses_gram(rows: int, cols: int, steps: int) -> bool:
    """Whether the Gram iteration costs fewer FLOPs on a rows x cols matrix: one over 1.5 times as wide as it is tall,
    at 5 steps (not a square one)."""
    return _gram_flops(rows, cols, steps) < _standard_flops(rows, cols, steps)


def _tall(matrix: Tensor) -> bool:
    return matrix.size(0) > matrix.size(1)


def _wide(matrix: Tensor) -> Tensor:
    return matrix.mT if _tall(matrix) else matrix


def iteration_flops(rows: int, cols: int, steps: int, method: str = "standard") -> int:
    """The FLOPs of orthogonalizing one rows x cols matrix by `method` (the standard iteration where the Gram one
    would cost more: `uses_gram`)."""
    if method == "gram" and uses_gram(rows, cols, steps):
        return _gram_flops(rows, cols, steps)
    return _standard_flops(rows, cols, steps)


def _standard_flops(rows: int, cols: int, steps: int) -> int:
    """Per step X X^T, b A + c A A and a X + B X."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def _gram_flops(rows: int, cols: int, steps: int) -> int:
    """X X^T at the start, Q X at the end, and both at the restart (m x m by m x n each); per step the polynomial,
    Q's product (not at the first step or the restart) and R's two (not where the last step or the restart
    follows), m x m by m x m each."""
    m, n = min(rows, cols), max(rows, cols)
    rectangular = 2 + 2 * (RESTART_AT < steps)
    square = sum(
        1 + (k > 0 and k != RESTART_AT) + 2 * (k + 1 < steps and k + 1 != RESTART_AT) for k in range(steps)
    )
    return 2 * m * m * n * rectangular + 2 * m**3 * square
