"""The parallel side of mixture-of-experts blocks (models/moe.py), for any family's plan: which ranks' tokens a
router's load-balancing counts add up over (`set_count_group`), and expert parallelism (`apply_ep`,
`strategy.ep`): each block's experts sharded over the ep ranks, tokens sent to the rank of their expert and back
with `all_to_all_single` (uneven splits), the experts' shards FSDP-sharded over the data-parallel ranks ep does
not use.
"""

from __future__ import annotations

import torch.distributed as dist

from parallama.models.moe import moe_blocks

_groups: dict = {}  # (dims, tuple of ranks) -> the process group, made once per layout


def batch_ranks(dims, rank: int) -> list[int]:
    """The ranks that hold other tokens than `rank` in the same model part: those that differ from it on
    dp_replicate, dp_shard or cp only (same pp stage, same tp rank)."""
    mine = dims.coordinates(rank)
    return [r for r in range(dims.world_size) if all(dims.coordinates(r)[d] == mine[d] for d in ("pp", "tp"))]


def set_count_group(model, options) -> None:
    """Every block's routers add up their tokens per expert over the ranks that hold other tokens of the step
    (models/moe.py `auxiliary_loss`): the load-balancing loss is the global batch's under every layout."""
    dims = options.dims
    if dims.dp_size * dims.cp == 1 or not dist.is_initialized():
        return
    if dims.dp_size * dims.cp == dims.world_size:
        group = dist.group.WORLD
    else:  # every rank makes every group, in the same order (new_group's rule)
        partition = sorted({tuple(batch_ranks(dims, r)) for r in range(dims.world_size)})
        key = (dims, tuple(partition))
        if key not in _groups:
            _groups[key] = {ranks: dist.new_group(list(ranks)) for ranks in partition}
        group = _groups[key][tuple(batch_ranks(dims, dist.get_rank()))]
    for block in moe_blocks(model):
        block.count_group = group
