"""ParallelDims: the mesh's sizes, resolved and checked in one place, and which batch each rank trains on."""

import pytest
from omegaconf import OmegaConf

from parallama.distributed.dims import ParallelDims, dims_of_config
from parallama.errors import ConfigError


def test_one_dp_size_takes_the_rest_of_the_world():
    assert ParallelDims.resolve(8) == ParallelDims(dp_shard=8)
    assert ParallelDims.resolve(8, dp_replicate=-1, dp_shard=1) == ParallelDims(dp_replicate=8)
    dims = ParallelDims.resolve(16, dp_replicate=2, tp=2, pp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp) == (2, 2, 2, 2, 1)
    assert (dims.world_size, dims.dp_size, dims.batch_share) == (16, 4, 0.25)


@pytest.mark.parametrize(
    "world, sizes, message",
    [
        (6, {"tp": 4}, "the layout dp_shard=-1 x tp=4 needs a multiple of 4 ranks, but the world size is 6"),
        (8, {"dp_shard": 2, "tp": 2}, "the layout dp_shard=2 x tp=2 is 4 ranks, but the world size is 8"),
        (8, {"dp_replicate": -1, "dp_shard": -1}, "are both -1"),
        (8, {"tp": -1}, "strategy.tp=-1 is not valid; use an integer >= 1"),  # -1: a dp size only
        (8, {"cp": 0}, "strategy.cp=0 is not valid"),
        (8, {"pp": True}, "strategy.pp=true is not valid"),
        (8, {"ep": 0}, "strategy.ep=0 is not valid; use an integer >= 1"),
    ],
)
def test_a_layout_that_does_not_fit_the_world_is_one_line(world, sizes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        ParallelDims.resolve(world, **sizes)
    assert "\n" not in str(err.value)


def test_tp_is_innermost_and_ranks_that_differ_in_tp_cp_or_pp_share_a_batch():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1)
    coords = [dims.coordinates(rank) for rank in range(dims.world_size)]
    assert [c["tp"] for c in coords] == [0, 1] * 4
    assert [dims.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    pp = ParallelDims(dp_shard=2, pp=2)
    assert [pp.coordinates(r)["pp"] for r in range(4)] == [0, 0, 1, 1]
    assert [pp.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]


def test_the_config_names_the_layout_and_strategies_without_one_are_data_parallel():
    cfg = OmegaConf.create({"trainer": {"devices": 4, "num_nodes": 2, "accelerator": "cpu"}, "strategy": {}})
    assert dims_of_config(cfg) == ParallelDims(dp_shard=8)
    cfg.strategy = {"tp": 2, "dp_replicate": 2}
    assert dims_of_config(cfg).dp_size == 4
