"""FSDP2 (`strategy=fsdp`): `fully_shard` per decoder block, then the root, over all ranks.

Runs through Lightning's ModelParallelStrategy, which works on CPU (gloo) and GPU (NCCL); the sharding itself
is `apply_fsdp` (parallel/apply.py) over the mesh's `dp_shard` dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from parallama.checkpoint.atomic import AtomicFolderCheckpoints
from parallama.config.schema import BOOL, check_arguments
from parallama.distributed.float8 import plain_tensors
from parallama.distributed.options import FSDPOptions, ParallelizeOptions
from parallama.errors import ConfigError
from parallama.parallel.base import Parallelism
from parallama.parallel.plan import MemoryProfile
from parallama.rules import Rule, key

FSDP = "strategy=fsdp"


@dataclass
class FSDPKeys:
    conf: ClassVar[str] = "strategy/fsdp.yaml"

    reshard_after_forward: bool = key(True, BOOL)
    mixed_precision: str | None = key(None, Rule(str, choices=("bf16", "fp16"), allow=(None,)))
    cpu_offload: bool = key(False, BOOL)
    meta_init: bool = key(False, BOOL)
    save_distributed_checkpoint: bool = key(True, BOOL)


class FSDP2(Parallelism, AtomicFolderCheckpoints, ModelParallelStrategy):
    """Parameters, gradients and optimizer state all sharded; each block gathered only while it computes.

    reshard_after_forward: True frees gathered parameters after each block's forward (ZeRO-3),
        False keeps them until backward (ZeRO-2: more memory, less communication).
    mixed_precision: None (parameters compute in their own dtype), "bf16" or "fp16": compute in that
        dtype, reduce gradients in fp32, keep fp32 master weights.
    cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
    meta_init: build the model on the meta device and initialize only each rank's shard (needed when a
        full fp32 copy does not fit in host memory). False draws the full model on every rank first, so
        the initial weights equal those of every other strategy for the same seed.
    save_distributed_checkpoint: a DCP folder of shards (true) or one full file written by rank 0.
    """

    name = "fsdp"
    config_keys = FSDPKeys
    memory_profiles = (
        MemoryProfile(
            "fsdp_zero2",
            FSDP + " strategy.reshard_after_forward=false",
            "fsdp",
            "pgo",
            gathered="all",
            guide="sharded",
            order=3,
        ),
        MemoryProfile("fsdp", FSDP, "fsdp", "pgo", gathered="working", guide="fully sharded"),
        MemoryProfile(
            "fsdp_offload",
            FSDP + " strategy.cpu_offload=true",
            "fsdp",
            "pgo",
            "pgo",
            "working",
            guide="offload",
            order=1,
        ),
    )

    def __init__(
        self,
        reshard_after_forward: bool = True,
        mixed_precision: Literal["bf16", "fp16"] | None = None,
        cpu_offload: bool = False,
        meta_init: bool = False,
        save_distributed_checkpoint: bool = True,
        **kwargs,
    ) -> None:
        check_arguments("strategy", FSDPKeys, mixed_precision=mixed_precision)
        # Lightning's own 2-D mesh ("auto": nodes x processes per node) is not used: the mesh that shards the
        # model is `Parallelism.mesh`, and the data-parallel rank is `dims`'.
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.reshard_after_forward = reshard_after_forward
        self.mixed_precision = mixed_precision
        self.cpu_offload = cpu_offload
        self.meta_init = meta_init
        self.save_distributed_checkpoint = save_distributed_checkpoint

    @property
    def checkpoint_format(self) -> str:
        return "dcp" if self.save_distributed_checkpoint else "file"

    def layout(self) -> dict[str, int]:
        return {"dp_shard": -1}

    # --- the model --------------------------------------------------------------------------------------

    def model_init_context(self):
        return torch.device("meta") if self.meta_init else super().model_init_context()

    def load_pretrained(self, model, load) -> None:
        if self.meta_init:
            raise ConfigError("init_from needs the full model in host memory: set strategy.meta_init=false")
        super().load_pretrained(model, load)

    def parallelize_options(self, **kwargs) -> ParallelizeOptions:
        fsdp = FSDPOptions(self.reshard_after_forward, self.mixed_precision, self.cpu_offload)
        return replace(super().parallelize_options(**kwargs), mesh=self.mesh, fsdp=fsdp)

    # float8 with FSDP2's float8 all-gather: checkpoints hold plain tensors (distributed/float8.py `plain_tensors`)

    def lightning_module_state_dict(self) -> dict:
        state = super().lightning_module_state_dict()
        return plain_tensors(state) if self.float8 is not None else state

    def optimizer_state(self, optimizer) -> dict:
        state = super().optimizer_state(optimizer)
        return plain_tensors(state) if self.float8 is not None else state

    def parallelize(self, model, plan, **kwargs):
        model = super().parallelize(model, plan, **kwargs)
        if self.meta_init:
            model.to_empty(device=self.offload_device)
            model.init_weights()
        return model

    @property
    def offload_device(self) -> torch.device:
        """Where the sharded parameters live: the CPU under cpu_offload (FSDP2 copies each to the device when it
        gathers it), else the rank's device."""
        return torch.device("cpu") if self.cpu_offload else self.root_device

    def model_to_device(self) -> None:
        """Lightning moves the whole LightningModule to the device after configure_model. Under cpu_offload the
        sharded model keeps its parameters on the CPU (FSDP2 refuses offloaded ones found on the GPU) and sends
        only its buffers (the rotary tables); the rest of the module (the metrics) goes whole."""
        if not self.cpu_offload:
            return super().model_to_device()

        for child in self.model.children():
            if not any(isinstance(m, FSDPModule) for m in child.modules()):
                child.to(self.root_device)
                continue
            for module in child.modules():
                for name, buffer in list(module.named_buffers(recurse=False)):
                    setattr(module, name, buffer.to(self.root_device))

    def setup_optimizers(self, trainer) -> None:
        """The optimizer must hold the sharded parameters. Under cpu_offload FSDP2 leaves the blocks' gathered ones
        registered after the first forward (validate_before_training's), so every module is resharded first."""

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        super().setup_optimizers(trainer)

    # --- checkpoints ------------------------------------------------------------------------------------

    def checkpoint_info(self, module) -> dict:
        info = super().checkpoint_info(module)
        if (
            self.checkpoint_format == "file"
        ):  # Lightning numbers FSDP's full optimizer state by parameter order
            info["optimizer_keys"] = [n for n, _ in module.named_parameters()]
        return info

    def load_universal(self, state) -> None:
        module, full = self.lightning_module, StateDictOptions(full_state_dict=True, strict=True)
        set_model_state_dict(module, state.model, options=full)
        if state.optimizer is not None:
            for optimizer in self.optimizers:
                set_optimizer_state_dict(module, optimizer, state.optimizer, options=full)
