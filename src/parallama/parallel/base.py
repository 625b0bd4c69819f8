"""What parallama asks of a strategy, in one class that every strategy of the `strategy` group mixes in.

A strategy class declares:
- `name` and `memory_profiles`: what parallama-plan estimates for it (see `MemoryProfile`);
- `mesh_shape`: its device mesh, with named dimensions `dp_replicate`, `dp_shard` and `tp` (tensor parallel,
  1 for now). The data-parallel rank and size (what the data module shards by, what tokens-seen and
  throughput count) come from it, never from the world size;
- `model_init_context` / `init_weights` / `parallelize`: how the model is built (meta device, ZeRO-3
  partitioned) and parallelized (the `apply_*` functions of parallel/apply.py, with explicit arguments);
- `make_optimizer`: the optimizer (DeepSpeed's CPU Adam when it offloads);
- `checkpoint_format`, `loads_natively` and `load_universal`: its checkpoint, and how it resumes any other
  strategy's (see parallel/universal.py).
Adding a strategy = one such class + one conf/strategy/<name>.yaml whose `_target_` is the class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch

from parallama.checkpoint import universal
from parallama.checkpoint.formats import LIGHTNING_TENSORS

log = logging.getLogger("parallama")
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class MemoryProfile:
    """Where one configuration of a strategy keeps model states, for parallama-plan.

    `shard` (1/n each) and `offload` (to CPU) name them by letter: p(arams) g(rads) o(ptimizer state);
    `gathered`: none, "working" (root + 2 blocks) or "all" parameters held unsharded at once. `engine`:
    "autocast" (Lightning's mixed precision), "deepspeed" or "fsdp" (their own). `guide`: the step of the
    guide in docs/strategies.md where it is tried (ddp, sharded, fully sharded, offload), in `order`.
    """

    name: str
    overrides: str
    engine: str
    shard: str = ""
    offload: str = ""
    gathered: str = "none"
    guide: str = "ddp"
    order: int = 0


class Parallelism:
    """Mixed into a Lightning strategy (first in the bases, so its hooks wrap Lightning's)."""

    name: ClassVar[str]
    checkpoint_format: ClassVar[str] = "file"
    memory_profiles: ClassVar[tuple[MemoryProfile, ...]] = ()
    _universal_loaded = False

    # --- device mesh ------------------------------------------------------------------------------------

    def mesh_shape(self) -> dict[str, int]:
        """Sizes of MESH_DIMS, outermost first; their product is the world size. Default: replicas."""
        return {"dp_replicate": self.world_size, "dp_shard": 1, "tp": 1}

    @property
    def data_parallel_size(self) -> int:
        shape = self.mesh_shape()
        return shape["dp_replicate"] * shape["dp_shard"]

    @property
    def data_parallel_rank(self) -> int:
        """The rank's coordinate on the flattened (dp_replicate, dp_shard) dimensions: tp is innermost."""
        return self.global_rank // self.mesh_shape()["tp"]

    @property
    def device_mesh_named(self):
        """torch's DeviceMesh with MESH_DIMS, built on first use (after the process group exists)."""
        if getattr(self, "_named_mesh", None) is None:
            from torch.distributed.device_mesh import init_device_mesh

            shape = self.mesh_shape()
            self._named_mesh = init_device_mesh(
                self.root_device.type, tuple(shape[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS
            )
        return self._named_mesh

    # --- the model --------------------------------------------------------------------------------------

    def model_init_context(self):
        """Where the model is built (e.g. on the meta device)."""
        return nullcontext()

    def init_weights(self, model) -> None:
        """After building, before `load_pretrained`: the constructor's initialization stands by default."""

    def load_pretrained(self, model, load: Callable[[torch.nn.Module], None]) -> None:
        """`load(model)` fills it with a pretrained model's weights (`init_from`)."""
        load(model)

    @staticmethod
    def param_shape(param: torch.nn.Parameter) -> torch.Size:
        """A parameter's logical shape (which decides its weight decay)."""
        return param.shape

    def parallelize(self, model, *, compile: bool, activation_checkpointing: bool):
        from parallama.models.llama.parallelize import apply_ac, apply_compile

        if activation_checkpointing:
            apply_ac(model)
        if compile:
            apply_compile(model)
        return model

    def compute_loss(self, module, batch: dict) -> torch.Tensor:
        """The batch's loss, the same on every rank (`module.loss(batch)`: a forward pass and cross-entropy)."""
        return module.loss(batch)

    def inference_model(self, model):
        """The model that `models.generation.generate` runs on every rank (the end-of-run sample)."""
        return model

    def make_optimizer(self, groups: list[dict], *, fused: bool | None, **kwargs) -> torch.optim.Optimizer:
        if fused is None:
            fused = self.root_device.type == "cuda"
        return torch.optim.AdamW(groups, fused=fused or None, **kwargs)

    # --- checkpoints ------------------------------------------------------------------------------------

    def checkpoint_info(self, module) -> dict:
        """Stored in every checkpoint (`checkpoint["parallel"]`): who wrote it and how its optimizer state
        is numbered."""
        info = {"strategy": self.name, "world_size": self.world_size, "format": self.checkpoint_format}
        optimizers = module.trainer.optimizers
        if self.checkpoint_format == "file" and optimizers:
            info["optimizer_keys"] = universal.names_in_group_order(optimizers[0], module)
        return info

    def loads_natively(self, info: dict) -> bool:
        """Whether Lightning's own loading of this checkpoint is exact here (else: the universal path)."""
        return info.get("strategy", self.name) == self.name and info["format"] == self.checkpoint_format

    def load_universal(self, state: universal.UniversalState) -> None:
        """Plain modules and torch optimizers (also ZeroRedundancyOptimizer, which takes the full state)."""
        module = self.lightning_module
        module.load_state_dict(state.model, strict=True)
        if state.optimizer is not None:
            name_of = {id(p): n for n, p in module.named_parameters()}
            for optimizer in self.optimizers:
                optimizer.load_state_dict(
                    universal.keyed_by_index(state.optimizer, optimizer.param_groups, name_of)
                )

    # Lightning's hooks: the universal path replaces its loading of model and optimizer state.

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer exists when the checkpoint is read: the universal path fills it

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._universal_loaded and super().lightning_restore_optimizer

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        info = universal.writer_info(checkpoint_path)
        if self.loads_natively(info):
            self._universal_loaded = False
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if self.global_rank == 0:
            log.info(
                f"resuming a {info.get('strategy', info['format'])} checkpoint "
                f"(world size {info.get('world_size', '?')}) under {self.name} at world size {self.world_size}"
            )
        state = universal.read(checkpoint_path)
        self.load_universal(state)
        self._universal_loaded = True
        return {k: v for k, v in state.client.items() if k not in LIGHTNING_TENSORS}

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not self._universal_loaded:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if not self._universal_loaded:
            super().load_optimizer_state_dict(checkpoint)


def data_parallel(trainer) -> tuple[int, int]:
    """(size, rank) of the data-parallel group: what the data module shards by and tokens-seen counts."""
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if isinstance(strategy, Parallelism):
        return strategy.data_parallel_size, strategy.data_parallel_rank
    return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
