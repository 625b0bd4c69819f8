"""One device, DDP (`ddp`, `ddp_spawn`) and ZeRO-1 (`ddp_sharded`): every rank holds the whole model.

- `auto`: one device; with several (trainer.devices, trainer.num_nodes) it is `ddp`, as Lightning's `auto`.
- `ddp_sharded`: Lightning 2.x dropped FairScale's strategy of that name; the same idea today is DDP plus
  PyTorch's `ZeroRedundancyOptimizer` (ZeRO-1: each rank keeps 1/world of the optimizer state).
All write single-file checkpoints, with the full optimizer state (ZeroRedundancyOptimizer consolidates it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from parallama.config.schema import BOOL
from parallama.distributed.dims import processes_per_node
from parallama.parallel.base import PROCESS_GROUP_BACKEND, Parallelism
from parallama.parallel.plan import MemoryProfile
from parallama.rules import Rule, key


@dataclass
class DDPKeys:
    conf: ClassVar[str] = "strategy/ddp.yaml"  # ddp_sharded.yaml and ddp_spawn.yaml: some of its keys

    process_group_backend: str | None = key(None, PROCESS_GROUP_BACKEND)
    find_unused_parameters: bool = key(False, BOOL)
    gradient_as_bucket_view: bool = key(True, BOOL)
    static_graph: bool = key(False, BOOL)
    bucket_cap_mb: float = key(25, Rule(float, 0, open="low"))


class SingleDevice(Parallelism, SingleDeviceStrategy):
    """One process on one device: the accelerator's first (Lightning fills `parallel_devices`)."""

    name = "auto"

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.parallel_devices: list[torch.device] | None = None

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0] if self.parallel_devices else super().root_device


class DDP(Parallelism, DDPStrategy):
    """Lightning's DDPStrategy: a full replica per rank, gradients all-reduced in buckets during backward."""

    name = "ddp"
    config_keys = DDPKeys
    memory_profiles = (MemoryProfile("ddp", "strategy=ddp", "autocast", guide="ddp"),)


class DDPSpawn(DDP):
    """DDP whose ranks are spawned from the main process instead of re-running the command (notebooks).
    Same memory as ddp, so the planner does not list it separately."""

    name = "ddp_spawn"
    memory_profiles = ()
    reruns_the_command = False

    def __init__(self, **kwargs) -> None:
        super().__init__(start_method="spawn", **kwargs)


class ShardedDDP(DDP):
    """DDP whose optimizer state is sharded across ranks (ZeRO stage 1)."""

    name = "ddp_sharded"
    memory_profiles = (
        MemoryProfile("ddp_sharded", "strategy=ddp_sharded", "autocast", "o", guide="sharded"),
    )

    def layout(self) -> dict[str, int]:
        return {"dp_shard": -1}  # the optimizer state's shards

    def setup_optimizers(self, trainer) -> None:
        # start-up time: torch.distributed.optim scripts its functional optimizers on import (0.4 s a process)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        super().setup_optimizers(trainer)
        sharded = []
        for optimizer in self.optimizers:
            groups = [dict(group) for group in optimizer.param_groups]
            accepted = inspect.signature(type(optimizer).__init__).parameters
            defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), **defaults)
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is optimizer:
                    config.scheduler.optimizer = zero
            sharded.append(zero)
        self.optimizers = sharded


def auto(devices="auto", num_nodes: int = 1, accelerator: str = "auto") -> Parallelism:
    """`strategy=auto`: SingleDevice for one device in all, else DDP (what Lightning's `auto` picks)."""
    return SingleDevice() if processes_per_node(devices, accelerator) * num_nodes == 1 else DDP()
