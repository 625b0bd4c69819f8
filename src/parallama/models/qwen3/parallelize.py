"""Qwen3's parallelize plan: the Llama's (models/llama/parallelize.py), whose tensor-parallel block plan gains the
q/k norms. Their input, q or k as (B, T, heads, head_dim), holds this rank's heads (q_proj and k_proj are
column-wise): `SequenceParallel(sequence_dim=2)` (torchtitan's Qwen3 plan) makes the weight a replicated DTensor
whose gradient, each rank's partial sum over its own heads, is all-reduced over the tp ranks."""

from __future__ import annotations

import functools

from torch.distributed.tensor.parallel import SequenceParallel

from parallama.models.llama.parallelize import parallelize as llama_parallelize
from parallama.models.llama.parallelize import tp_block_plan


def qwen3_block_plan(*, sequence_parallel: bool, between) -> dict:
    plan = tp_block_plan(sequence_parallel=sequence_parallel, between=between)
    plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


parallelize = functools.partial(llama_parallelize, block_plan=qwen3_block_plan)
