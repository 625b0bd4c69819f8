"""The compiled Newton-Schulz iteration (what optimizer=muon runs on CUDA, training/newton_schulz.py) gives the eager
one's results, for the standard and the Gram iteration (`ns_method`): compiled here on CPU (inductor's C++), in fp32,
where only the order of the norm's sums may differ.
In bf16 the compiled GEMMs round their scaled sums once more than eager's baddbmm (about 1e-2 after 5 steps), as
bf16 allows. About 20 s on 2 cores: the compiler's start."""

from __future__ import annotations

import pytest
import torch

from parallama.training.newton_schulz import compiled_newton_schulz, iteration

COEFFICIENTS, STEPS, EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_the_compiled_iteration_equals_the_eager_one(method):
    generator = torch.Generator().manual_seed(0)
    batch = torch.randn(3, 8, 16, generator=generator)
    batch[1] *= 1000  # each matrix its own norm, compiled too
    compiled = compiled_newton_schulz(method)(batch, COEFFICIENTS, STEPS, EPS, torch.float32)
    eager = iteration(method)(batch, COEFFICIENTS, STEPS, EPS, torch.float32)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=2e-6)
    assert compiled.abs().max() > 0.1  # orthogonalized, not vanished
