"""DeepSpeed ZeRO (`strategy=deepspeed`, stage 1/2/3, optional CPU offload), runnable on CPU too.

Lightning refuses DeepSpeed on anything but CUDA; DeepSpeed itself has a CPU accelerator. On CPU the root
device is `cpu:<local_rank>` (tensors on it are plain CPU tensors: Lightning hands DeepSpeed the device's
index as the rank's) and communication goes over gloo. GPU runs take Lightning's path unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from omegaconf import DictConfig

from parallama.checkpoint.atomic import AtomicFolderCheckpoints
from parallama.checkpoint.zero import load_into_deepspeed
from parallama.config.schema import BOOL
from parallama.errors import ConfigError
from parallama.parallel.base import PROCESS_GROUP_BACKEND, Parallelism
from parallama.parallel.plan import MemoryProfile
from parallama.rules import Rule, key
from parallama.runtime import compat
from parallama.runtime.launch import remove_stale_build_locks

log = logging.getLogger("parallama")
_DS = "strategy=deepspeed strategy.stage="
_OFFLOAD = " strategy.offload_optimizer=true"


@dataclass
class DeepSpeedKeys:
    conf: ClassVar[str] = "strategy/deepspeed.yaml"

    stage: int = key(2, Rule(int, choices=(1, 2, 3)))
    offload_optimizer: bool = key(False, BOOL)
    offload_parameters: bool = key(False, BOOL)
    process_group_backend: str | None = key(None, PROCESS_GROUP_BACKEND)
    logging_batch_size_per_gpu: int = key("${data.batch_size}")


class DeepSpeed(Parallelism, AtomicFolderCheckpoints, DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy. ZeRO-1 shards the optimizer state, 2 also gradients, 3 also parameters
    (the model is then built inside `deepspeed.zero.Init`, partitioned as each module is created)."""

    name = "deepspeed"
    checkpoint_format = "deepspeed"
    config_keys = DeepSpeedKeys
    internals = tuple(compat.DEEPSPEED_INTERNALS)
    memory_profiles = (
        MemoryProfile("deepspeed_1", _DS + "1", "deepspeed", "o", guide="sharded", order=1),
        MemoryProfile("deepspeed_2", _DS + "2", "deepspeed", "go", guide="sharded", order=2),
        MemoryProfile(
            "deepspeed_3", _DS + "3", "deepspeed", "pgo", gathered="working", guide="fully sharded", order=1
        ),
        MemoryProfile("deepspeed_2_offload", _DS + "2" + _OFFLOAD, "deepspeed", "go", "go", guide="offload"),
        MemoryProfile(
            "deepspeed_3_offload",
            _DS + "3" + _OFFLOAD + " strategy.offload_parameters=true",
            "deepspeed",
            "pgo",
            "pgo",
            "working",
            guide="offload",
            order=2,
        ),
    )

    @classmethod
    def refusal(cls, cfg: DictConfig, optimizer: type) -> str | None:
        """An optimizer other than Adam(W) with the optimizer offloaded (`offload_refusal`), Muon (ZeRO flattens
        and partitions the matrices it orthogonalizes whole), float8 (untested under ZeRO's partitioning)."""
        if cfg.strategy.get("offload_optimizer") and (message := offload_refusal(optimizer)):
            return message
        if getattr(optimizer, "takes_hidden_matrices", False):  # Muon's (training/muon.py)
            return (
                "optimizer=muon cannot run under strategy=deepspeed (ZeRO partitions the matrices Muon needs "
                "whole); use strategy=fsdp, ddp, ddp_sharded or model_parallel, or optimizer=adamw"
            )
        if (recipe := cfg.get("float8")) is not None:
            return (
                f"float8={recipe} is not supported under strategy=deepspeed (its partitioning of torchao's "
                "Float8Linear is untested); use strategy=fsdp, model_parallel, ddp or auto, or float8=null"
            )
        return None

    def layout(self) -> dict[str, int]:
        return {"dp_shard": -1}

    def setup_environment(self) -> None:
        # A build killed moments ago leaves a lock too young to call stale at start (runtime/launch.py): watch it
        # while DeepSpeed may still build or wait, so a run never waits for it for ever.
        threading.Thread(target=watch_build_locks, daemon=True, name="parallama-build-locks").start()
        if self.root_device.type == "cpu":
            compat.skip_deepspeed_shm_comm()
            _say_if_ops_will_build(self.local_rank, self.offload_optimizer)
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
            compat.setup_deepspeed_environment_on_cpu(self)  # skip only DeepSpeedStrategy's CUDA check
        else:
            super().setup_environment()

    @property
    def offload_optimizer(self) -> bool:
        return "offload_optimizer" in self.config.get("zero_optimization", {})

    # --- the model --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _gathered(self, model):
        """ZeRO-3 partitions each parameter as soon as its module exists: gather them so that rank 0's writes
        (initialization, pretrained weights) are scattered to every rank. Other stages: nothing to do."""
        params = [p for p in model.parameters() if hasattr(p, "ds_id")]
        if not params:
            yield False
            return
        import deepspeed  # start-up time (deepspeed)

        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            yield True

    def init_weights(self, model) -> None:
        with self._gathered(model) as zero3:
            if zero3:
                model.init_weights()  # the constructor's init wrote into empty shards: redo it, gathered

    def load_pretrained(self, model, load) -> None:
        with self._gathered(model):
            super().load_pretrained(model, load)

    @staticmethod
    def param_shape(param: torch.nn.Parameter) -> torch.Size:
        return getattr(param, "ds_shape", param.shape)  # ZeRO-3 keeps a partitioned tensor's real shape here

    def build_optimizer(self, factory, groups: list[dict]):
        """With the optimizer offloaded, DeepSpeed steps on the CPU with its own Adam: the configured Adam or AdamW
        becomes DeepSpeedCPUAdam with the same settings; any other class is refused (app/checks.py says so
        before work, `offload_refusal`)."""
        if not self.offload_optimizer:
            return super().build_optimizer(factory, groups)
        if message := offload_refusal(factory.func):
            raise ConfigError(message)
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # start-up time (deepspeed): offload's CPU Adam

        settings = {k: v for k, v in factory.keywords.items() if k in CPU_ADAM_KEYS}
        return DeepSpeedCPUAdam(groups, adamw_mode=factory.func is torch.optim.AdamW, **settings)

    # --- checkpoints ------------------------------------------------------------------------------------

    def checkpoint_info(self, module) -> dict:
        zero = self.config.get("zero_optimization", {})
        return {
            **super().checkpoint_info(module),
            "stage": zero.get("stage"),
            "offload": self.offload_optimizer,
            "precision": module.trainer.precision,  # bf16: its model file holds bf16 weights
        }

    def loads_natively(self, info: dict) -> bool:
        """DeepSpeed reads its ZeRO partitions back only as they were written: same world size, stage, offload
        and precision (checkpoints that predate the precision record are taken as written in this one)."""
        zero = self.config.get("zero_optimization", {})
        same = info.get("world_size") == self.world_size and info.get("stage") == zero.get("stage")
        same = same and info.get("offload") == self.offload_optimizer
        precision = self.lightning_module.trainer.precision
        return super().loads_natively(info) and same and info.get("precision", precision) == precision

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        compat.keep_configured_gradient_clipping(self.deepspeed_engine)
        return checkpoint

    def load_universal(self, state) -> None:
        load_into_deepspeed(self, self.lightning_module, state.model, state.optimizer)


CPU_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def watch_build_locks(seconds: float = 600, every: float = 10) -> None:
    """`remove_stale_build_locks` every `every` seconds for `seconds` (the ops build in about a minute)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        remove_stale_build_locks(Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_root())))
        time.sleep(every)


def extensions_root() -> Path:
    """Where torch builds DeepSpeed's ops when nothing chose a folder (parallama's tools give each environment
    its own: runtime/launch.py)."""
    return Path.home() / ".cache" / "torch_extensions"


def _say_if_ops_will_build(local_rank: int, offload_optimizer: bool) -> None:
    """On CPU the optimizer offload's CPU Adam is compiled at its first run: a minute of silence."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_root()))
    if offload_optimizer and local_rank == 0 and not any(root.glob("cpu_adam/*.so")):
        log.info(f"building DeepSpeed's CPU Adam (once per environment, ~1 min) in {root}")


def offload_refusal(optimizer_class: type) -> str | None:
    """Why DeepSpeed's optimizer offload, which steps with its own CPU Adam, cannot run `optimizer_class`."""

    if optimizer_class in (torch.optim.AdamW, torch.optim.Adam):
        return None
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    return (
        f"strategy.offload_optimizer=true steps with DeepSpeed's CPU Adam, not optimizer._target_={name}; use "
        "optimizer=adamw (or torch.optim.Adam) or strategy.offload_optimizer=false"
    )
