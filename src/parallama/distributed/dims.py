"""The shape of a run's device mesh, and the one place that knows the data-parallel size is not the world size.

A run's ranks form a mesh with five named dimensions, outermost first (torchtitan's order):
`pp` (pipeline stages), `dp_replicate` (replicas: DDP, or HSDP's outer dimension), `dp_shard` (ranks that shard
the model states: ZeRO / FSDP), `cp` (context: a sample's sequence split) and `tp` (tensor: a layer's weights
split). Their product is the world size. A batch belongs to a data-parallel rank, a coordinate of
(dp_replicate, dp_shard): the ranks that differ only in pp, cp or tp see the same batch. Everything that
counts data (the sampler, the global batch, tokens seen, throughput and MFU, the planner) asks `ParallelDims`.

Expert parallelism (`ep`, mixture-of-experts models) is not a dimension of its own: it borrows ranks from
`dp_shard`, which splits into (`dp_shard // ep`, `ep`), `ep` innermost. The ep ranks of a group hold other tokens
and each holds 1/ep of every block's experts (models/moe_parallel.py); the experts' shards are FSDP-sharded over
the `dp_shard // ep` ranks (and replicated over `dp_replicate`), the other parameters over all of `dp_shard`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from parallama.errors import ConfigError
from parallama.rules import Rule, check_value

# What each size accepts (config/schema.py states the strategy.<dim> keys with these): a dp size may be -1, the
# ranks the other dimensions leave.
SIZE, DP_SIZE = Rule(int, 1), Rule(int, 1, allow=(-1,))

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # borrowed from dp_shard (not in DIMS, not in world_size)

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
    ) -> ParallelDims:
        """The sizes for `world_size` ranks; one of the dp sizes may be -1, "the rest". Sizes that do not
        multiply out to the world size are one line naming them (`strategy.<dim>`)."""
        sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "pp": pp}
        for name, size in {**sizes, "ep": ep}.items():
            check_value(f"strategy.{name}", size, DP_SIZE if name.startswith("dp_") else SIZE)
        if dp_replicate == -1 and dp_shard == -1:
            raise ConfigError(
                "strategy.dp_replicate and strategy.dp_shard are both -1; give one of them a size"
            )
        given = math.prod(size for size in sizes.values() if size != -1)
        shape = " x ".join(f"{name}={size}" for name, size in sizes.items() if size != 1)
        if world_size % given:
            raise ConfigError(
                f"the layout {shape or 'dp=1'} needs a multiple of {given} ranks, but the world size is "
                f"{world_size} (trainer.devices x trainer.num_nodes)"
            )
        for name in ("dp_replicate", "dp_shard"):
            if sizes[name] == -1:
                sizes[name] = world_size // given
        dims = cls(**sizes)
        if dims.world_size != world_size:
            raise ConfigError(
                f"the layout {shape} is {dims.world_size} ranks, but the world size is {world_size} "
                "(trainer.devices x trainer.num_nodes); set one dp size to -1 to take the rest"
            )
        if dims.dp_shard % ep:
            raise ConfigError(
                f"strategy.ep={ep} must divide strategy.dp_shard={dims.dp_shard} (expert parallelism shards the "
                f"experts over data-parallel ranks: {world_size} ranks give dp_shard={dims.dp_shard})"
            )
        if ep > 1 and cp > 1:
            raise ConfigError(f"strategy.ep={ep} with strategy.cp={cp} is not supported; use one of them")
        return replace(dims, ep=ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: how many different batches one optimizer step trains on."""
        return self.dp_replicate * self.dp_shard

    @property
    def batch_share(self) -> float:
        """The share of its batch's compute one rank does (1 / the ranks that see the same batch)."""
        return self.dp_size / self.world_size

    def coordinates(self, rank: int) -> dict[str, int]:
        """A global rank's coordinate on each dimension (row-major over DIMS, `tp` innermost)."""
        coords = {}
        for name in reversed(DIMS):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which batch a rank trains on: its coordinate on (dp_replicate, dp_shard)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def sizes(self) -> dict[str, int]:
        """The mesh's sizes, and `ep` where experts are sharded (what a checkpoint records)."""
        sizes = asdict(self)
        if self.ep == 1:
            del sizes["ep"]
        return sizes

    def build_expert_mesh(self, device_type: str):
        """The mesh of the experts' parameters: DIMS with dp_shard split into (dp_shard_mod_ep, ep)."""
        from torch.distributed.device_mesh import init_device_mesh  # torch-free module

        names = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
        shape = (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    def build_mesh(self, device_type: str):
        """torch's DeviceMesh over every dimension, named as DIMS (call it once the process group exists)."""
        from torch.distributed.device_mesh import init_device_mesh  # torch-free module

        return init_device_mesh(device_type, tuple(getattr(self, d) for d in DIMS), mesh_dim_names=DIMS)


def uses_gpu(accelerator: str) -> bool:
    """Whether `trainer.accelerator` puts this run on GPUs ("auto": when one is visible, as Lightning chooses)."""
    if accelerator in ("gpu", "cuda"):
        return True
    if accelerator != "auto":
        return False
    import torch  # torch-free module

    return torch.cuda.is_available()


def processes_per_node(devices, accelerator: str = "auto") -> int:
    """How many processes `trainer.devices` starts on a node: a count, a list of device ids, or "auto"/-1 (every
    GPU, or one process on a CPU-only machine, as Lightning counts them)."""
    import torch  # torch-free module

    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        return len([d for d in devices.split(",") if d.strip()]) if "," in devices else int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    return max(torch.cuda.device_count(), 1) if uses_gpu(accelerator) else 1


def dims_of_config(cfg) -> ParallelDims:
    """The layout a composed training config asks for: its world size (trainer.devices x trainer.num_nodes)
    split as the strategy's dimension keys say (strategies without them: every rank is data-parallel)."""
    trainer, strategy = cfg.trainer, cfg.get("strategy") or {}
    world = processes_per_node(trainer.devices, trainer.get("accelerator", "auto")) * trainer.num_nodes
    given = {name: strategy[name] for name in (*DIMS, "ep") if name in strategy}
    return ParallelDims.resolve(world, **given)
