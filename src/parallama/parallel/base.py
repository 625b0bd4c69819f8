"""What parallama asks of a strategy, in one class that every strategy of the `strategy` group mixes in.

A strategy class declares:
- `config_keys` and `refusal`: its keys' types, valid values and defaults (a dataclass of `rules.key` fields
  mirroring its conf file) and what it cannot run (a config's other keys, the optimizer), checked before any work
  (app/checks.py finds the class by `strategy._target_` and asks it, so a subclass of yours inherits both), and
  `internals`: the private ones of runtime/compat.py it relies on, checked before training;
- `name` and `memory_profiles`: what parallama-plan estimates for it (`parallel.plan.MemoryProfile`);
- `layout()`: how its ranks split into the dimensions of `parallel.dims.ParallelDims`. The data-parallel rank
  and size (what the data module shards by, what tokens-seen and throughput count) come from `dims`, never
  from the world size;
- `model_init_context` / `init_weights` / `parallelize_options`: how the model is built (meta device, ZeRO-3
  partitioned) and what the model family's own plan (models/<family>/parallelize.py) applies to it;
- `pipeline`, `cp_mesh`, `loss_context`: what its layout adds to a training step (the step itself, forward, loss
  and backward, is `CausalLM.step_loss` / `backward`), and `inference_model`: the model generation runs on;
- `build_optimizer`: the recipe's optimizer, built as configured (DeepSpeed's offload swaps in its CPU Adam);
- `checkpoint_format`, `loads_natively` and `load_universal`: its checkpoint, and how it resumes any other
  strategy's (see checkpoint/universal.py).
Adding a strategy = one such class + one conf/strategy/<name>.yaml whose `_target_` is the class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import ClassVar

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from omegaconf import DictConfig

from parallama.checkpoint import universal
from parallama.checkpoint.formats import LIGHTNING_TENSORS
from parallama.config.parts import locate_target
from parallama.distributed.dims import ParallelDims
from parallama.distributed.options import Float8Options, ParallelizeOptions
from parallama.rules import Rule
from parallama.runtime.quiet import quiet_known_warnings

log = logging.getLogger("parallama")
PROCESS_GROUP_BACKEND = Rule(str, choices=("nccl", "gloo"), allow=(None,))  # null: nccl on GPU, gloo on CPU


class Parallelism:
    """Mixed into a Lightning strategy (first in the bases, so its hooks wrap Lightning's)."""

    name: ClassVar[str]
    checkpoint_format: ClassVar[str] = "file"
    memory_profiles: ClassVar[tuple] = ()  # parallel.plan.MemoryProfile
    reruns_the_command: ClassVar[bool] = True  # its ranks run this job's command (not spawned by Lightning)
    config_keys: ClassVar[type | None] = None  # the dataclass of its `strategy.<key>`s (None: none checked)
    internals: ClassVar[tuple] = ()  # runtime.compat.Internal: the private ones it relies on
    _universal_loaded = False
    float8: str | None = None  # `float8` of conf/train.yaml (distributed/float8.py), set by parallama-train
    float8_filter: str = "auto"  # `float8_filter`: which block linears it converts

    @classmethod
    def refusal(cls, cfg: DictConfig, optimizer: type) -> str | None:
        """Why this strategy cannot run the composed training config `cfg` with the optimizer class it builds
        (one line), or None. Asked before any work; the default runs anything."""
        return None

    # --- the device mesh --------------------------------------------------------------------------------

    def setup_environment(self) -> None:
        quiet_known_warnings()  # in every rank: a spawned one never ran the command line's
        super().setup_environment()

    def layout(self) -> dict[str, int]:
        """This strategy's `ParallelDims.resolve` sizes (-1: the rest of the world). Default: replicas."""
        return {"dp_replicate": -1, "dp_shard": 1}

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims.resolve(self.world_size, **self.layout())

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """Lightning's question (for a loader it would shard itself): the data-parallel replicas, not the ranks."""
        dims = self.dims
        return {"num_replicas": dims.dp_size, "rank": dims.dp_rank(self.global_rank)}

    @property
    def mesh(self):
        """torch's DeviceMesh over `dims`, built on first use (after the process group exists)."""
        if getattr(self, "_named_mesh", None) is None:
            self._named_mesh = self.dims.build_mesh(self.root_device.type)
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

    def parallelize(self, model, plan: Callable, *, compile: bool, activation_checkpointing):
        """The model family's plan (`plan(model, options)`, models/<family>/parallelize.py) with this
        strategy's options. `activation_checkpointing`: a bool, a mode or {mode, policy, every_n}
        (`ACOptions.of`)."""
        options = self.parallelize_options(compile=compile, activation_checkpointing=activation_checkpointing)
        return plan(model, options)

    def parallelize_options(self, *, compile: bool, activation_checkpointing) -> ParallelizeOptions:
        """What the model's plan applies. Default: nothing sharded here (DDP and DeepSpeed shard by themselves)."""
        float8 = None
        if self.float8 is not None:  # torchao's emulation where there is no float8 matmul
            emulate = self.root_device.type != "cuda"
            float8 = Float8Options(self.float8, emulate=emulate, filter=self.float8_filter)
        return ParallelizeOptions(
            dims=self.dims,
            compile=compile,
            activation_checkpointing=activation_checkpointing,
            float8=float8,
        )

    # What a layout adds to a training step (CausalLM.step_loss runs it): none by default.
    pipeline = None  # parallel.pipeline.Pipeline: this rank's stages and their schedule
    cp_mesh = None  # the context-parallel mesh: each rank holds part of every sequence

    def loss_context(self):
        """Where the loss and its backward run (tensor parallel: the vocab-sharded loss)."""
        return nullcontext()

    def inference_model(self, model):
        """The model that `models.generation.generate` runs on every rank (the end-of-run sample)."""
        return model

    def build_optimizer(self, factory: Callable[[list[dict]], torch.optim.Optimizer], groups: list[dict]):
        """The optimizer the recipe names (`factory(groups)`, training/optim.py). A strategy that must run
        another one in its place (DeepSpeed's offload) overrides this, refusing in one line what it cannot run."""
        return factory(groups)

    def clip_gradients(self, optimizer, clip_val: float, algorithm) -> None:
        """The clipping of `trainer.gradient_clip_val` (Lightning's `configure_gradient_clipping` hook, which
        CausalLM hands here), through the precision plugin as Lightning does. bf16-mixed has no loss scaler: its
        gradients are true ones when clipped, also those of a fused optimizer (the default on GPU), which
        Lightning's MixedPrecision refuses to clip as it must under fp16's scaler."""
        plugin = self.precision_plugin
        unscaled = isinstance(plugin, MixedPrecision) and plugin.scaler is None
        (Precision.clip_gradients if unscaled else type(plugin).clip_gradients)(
            plugin, optimizer, clip_val, algorithm
        )

    # --- checkpoints ------------------------------------------------------------------------------------

    def checkpoint_info(self, module) -> dict:
        """Stored in every checkpoint (`checkpoint["parallel"]`): who wrote it and how its optimizer state
        is numbered."""
        info = {"strategy": self.name, "world_size": self.world_size, "format": self.checkpoint_format}
        info["dims"] = self.dims.sizes()
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


def strategy_class(strategy: DictConfig) -> type[Parallelism] | None:
    """The Parallelism class a `strategy` config node names by `_target_`: what declares its keys and refusals.
    None for a factory function (`auto`) or a Lightning strategy of the user's own; one line if it does not
    import."""

    target = strategy.get("_target_")
    if not target:
        return None
    found = locate_target(target, "strategy._target_")
    return found if isinstance(found, type) and issubclass(found, Parallelism) else None


class OutsideATrainer(Parallelism):
    """The defaults where no Lightning strategy runs (tests, notebooks, tools): one process, plain PyTorch."""

    name = "none"
    world_size, global_rank = 1, 0
    root_device = torch.device("cpu")
    precision_plugin = None  # no loss scaler


def data_parallel(trainer) -> tuple[int, int]:
    """(size, rank) of the data-parallel group: what the data module shards by and tokens-seen counts."""
    strategy = getattr(trainer, "strategy", None) if trainer is not None else None
    if isinstance(strategy, Parallelism):
        dims = strategy.dims
        return dims.dp_size, dims.dp_rank(strategy.global_rank)
    return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
