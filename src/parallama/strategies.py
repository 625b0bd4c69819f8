"""Strategies behind the Hydra `strategy` group (conf/strategy/*.yaml), where Lightning's own do not suffice.

- `ddp`, `ddp_spawn`: Lightning's `DDPStrategy` as is.
- `ddp_sharded`: Lightning 2.x dropped FairScale's strategy of that name; the same idea today is DDP plus
  PyTorch's `ZeroRedundancyOptimizer` (ZeRO-1: each rank keeps 1/world of the optimizer state).
- `deepspeed`: Lightning's `DeepSpeedStrategy`, allowed to run on CPU (DeepSpeed has a CPU accelerator;
  Lightning refuses anything but CUDA). GPU runs take Lightning's path unchanged.
- `fsdp`: FSDP2 (`fully_shard` per decoder block) through Lightning's `ModelParallelStrategy`, which runs
  on CPU (gloo) and GPU (NCCL). The sharding itself is applied in parallelize.py.
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from torch.distributed.optim import ZeroRedundancyOptimizer


def lightning_builtin(name: str = "auto") -> str:
    """A strategy Lightning knows by name (`auto`: one device, or DDP when several are given)."""
    return name


class AtomicFolderCheckpoints:
    """DeepSpeed and FSDP write a checkpoint as a folder, in place: a kill mid-write would leave a broken one.

    Write it next to the target as `<name>.partial`, then swap it in; until the swap the previous checkpoint
    stays whole (as `<name>` or, for an instant, `<name>.old`, which `ckpt_path=last` also finds).
    """

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        path = Path(filepath)
        partial, old = path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")
        if self.is_global_zero:
            _remove(partial)
        self.barrier("parallama_ckpt_clean")
        super().save_checkpoint(checkpoint, partial, storage_options=storage_options)
        self.barrier("parallama_ckpt_written")
        if self.is_global_zero:
            _remove(old)
            if path.exists():
                path.rename(old)
            partial.rename(path)
            _remove(old)
        self.barrier("parallama_ckpt_swapped")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class ShardedDDPStrategy(DDPStrategy):
    """DDP whose optimizer state is sharded across ranks (ZeRO stage 1)."""

    strategy_name = "ddp_sharded"

    def setup_optimizers(self, trainer) -> None:
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


class CPUCapableDeepSpeedStrategy(AtomicFolderCheckpoints, DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy, minus its CUDA-only guard when the accelerator is the CPU.

    Lightning hands DeepSpeed the root device's index as the rank's device and checks it against the local
    rank; a CPU device has none. So on CPU the root device is `cpu:<local_rank>` (tensors on it are plain
    CPU tensors) and communication goes over gloo. GPU runs take Lightning's path unchanged.
    """

    strategy_name = "deepspeed"

    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":
            _say_if_ops_will_build(self.local_rank)
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
            super(DeepSpeedStrategy, self).setup_environment()  # skip only DeepSpeedStrategy's CUDA check
        else:
            super().setup_environment()

    @property
    def offload_optimizer(self) -> bool:
        self._init_config_if_needed()
        return "offload_optimizer" in self.config.get("zero_optimization", {})


def _say_if_ops_will_build(local_rank: int) -> None:
    """On CPU DeepSpeed compiles its shared-memory communication op at the first run: minutes of silence."""
    import logging
    import os

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    if local_rank == 0 and not any(root.glob("deepspeed_shm_comm/*.so")):
        logging.getLogger("parallama").info(
            f"building DeepSpeed's C++ ops (once per environment, ~1 min) in {root}"
        )


class FSDP2Strategy(AtomicFolderCheckpoints, ModelParallelStrategy):
    """FSDP2 over all ranks (pure data parallel, no tensor parallel); options read by parallelize.py.

    reshard_after_forward: True frees gathered parameters after each block's forward (ZeRO-3),
        False keeps them until backward (ZeRO-2: more memory, less communication).
    mixed_precision: None (parameters compute in their own dtype), "bf16" or "fp16": compute in that
        dtype, reduce gradients in fp32, keep fp32 master weights.
    cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
    meta_init: build the model on the meta device and initialize only each rank's shard (needed when a
        full fp32 copy does not fit in host memory). False draws the full model on every rank first, so
        the initial weights equal those of every other strategy for the same seed.
    """

    strategy_name = "fsdp"

    def __init__(
        self,
        reshard_after_forward: bool = True,
        mixed_precision: Literal["bf16", "fp16"] | None = None,
        cpu_offload: bool = False,
        meta_init: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)
        if mixed_precision not in (None, "bf16", "fp16"):
            from parallama.errors import ConfigError

            raise ConfigError(f"strategy.mixed_precision={mixed_precision!r} is not one of null, bf16, fp16")
        self.reshard_after_forward = reshard_after_forward
        self.mixed_precision = mixed_precision
        self.cpu_offload = cpu_offload
        self.meta_init = meta_init

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
