"""strategy.ep (expert parallelism) refused in one line before any work where the layout cannot hold it, through
`preflight` as parallama-train runs it; and the ranks a router's balancing counts add up over (one per (pp, tp)
coordinate: those holding other tokens). Training: tests/distributed/test_moe_parallel.py."""

from __future__ import annotations

import pytest

from parallama import CONF_DIR
from parallama.app.compose import preflight
from parallama.distributed.dims import ParallelDims
from parallama.errors import ConfigError
from parallama.models.moe_parallel import batch_ranks

MOE = ["strategy=model_parallel", "trainer.accelerator=cpu", "model=qwen3_moe_tiny"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.devices=2", "strategy.ep=4"], "strategy.ep=4 must divide strategy.dp_shard=2"),
        (
            ["trainer.devices=4", "strategy.tp=2", "strategy.ep=4"],
            "strategy.ep=4 must divide strategy.dp_shard=2",
        ),
        (["trainer.devices=3", "strategy.ep=3"], "strategy.ep=3 must divide model.num_experts=8"),
        (["trainer.devices=2", "strategy.ep=0"], "strategy.ep=0 is not valid; use an integer >= 1"),
        (["trainer.devices=4", "strategy.cp=2", "strategy.ep=2"], "strategy.ep=2 with strategy.cp=2 is not"),
        (  # the default schedule: a backward before the step's second microbatch is routed
            ["trainer.devices=2", "strategy.pp=2"],
            "model.router_aux_loss_coef=0.01 balances the experts over the step's global batch, which "
            "strategy.pp_schedule=1f1b has not routed before its first backward (strategy.pp_microbatches=2 "
            "(the default)): use strategy.pp_schedule=gpipe, or loss-free balancing",
        ),
        (
            ["trainer.devices=2", "strategy.pp=2", "strategy.pp_schedule=interleaved_1f1b"],
            "strategy.pp_schedule=interleaved_1f1b has not routed before its first backward",
        ),
        (
            ["trainer.devices=2", "strategy.ep=2", "model=tiny"],
            "strategy.ep=2 shards a mixture of experts, but",
        ),
    ],
)
def test_a_layout_that_cannot_shard_the_experts_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        preflight(CONF_DIR, "train", [*MOE, *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy.pp_schedule=gpipe"],  # every forward before the first backward
        ["strategy.pp_schedule=gpipe", "strategy.pp_microbatches=1"],
        ["model.router_aux_loss_coef=0", "model.router_bias_update_rate=0.001"],  # loss-free: any schedule
        ["model.router_aux_loss_coef=0", "model.router_bias_update_rate=0.001", "strategy.pp_schedule=zbv"],
    ],
)
def test_a_pipeline_that_sees_the_steps_counts_runs_a_moe(overrides):
    preflight(CONF_DIR, "train", [*MOE, "trainer.devices=2", "strategy.pp=2", *overrides])


def test_the_balancing_counts_add_up_over_the_ranks_with_other_tokens():
    dims = ParallelDims(dp_shard=2, tp=2, ep=2)  # ranks (dp_shard, tp): 0 (0,0), 1 (0,1), 2 (1,0), 3 (1,1)
    assert [batch_ranks(dims, r) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert batch_ranks(ParallelDims(dp_replicate=2, dp_shard=2, ep=2), 3) == [0, 1, 2, 3]
