"""Every place parallama relies on a private internal of Lightning, torch or DeepSpeed, with why and where.

Private names change without notice between releases. `check_internals()` runs before training and refuses,
in one line naming the installed version, a Lightning/torch/DeepSpeed that lacks one of them, instead of an
AttributeError deep inside a run (or, for a patched function, a patch that silently does nothing). Code
elsewhere calls the functions below; subclasses that override a private hook list it in INTERNALS.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

from parallama.errors import ConfigError

TESTED = {"lightning": "2.6.6", "torch": "2.13.0", "deepspeed": "0.19.8"}  # pyproject.toml's pins


@dataclass(frozen=True)
class Internal:
    module: str
    name: str  # attribute path inside the module (a.b for a class attribute)
    why: str
    upstream: str


LIGHTNING = "https://github.com/Lightning-AI/pytorch-lightning/blob/2.6.0/src/lightning"
INTERNALS = [
    Internal(
        "lightning.pytorch.trainer.connectors.signal_connector",
        "_SignalConnector._sigterm_notifier_fn",
        "Lightning's SIGTERM notifier broadcasts from inside the signal handler, which deadlocks ranks that are "
        "in another collective; PreemptionCheckpoint registers its own in its place",
        f"{LIGHTNING}/pytorch/trainer/connectors/signal_connector.py",
    ),
    Internal(
        "lightning.pytorch.strategies.launchers.subprocess_script",
        "_hydra_subprocess_cmd",
        "ddp re-runs sys.argv for ranks > 0; under a Hydra sweep that re-runs the sweep: each rank must run "
        "exactly its parent's job (launch.ddp_child_command)",
        f"{LIGHTNING}/pytorch/strategies/launchers/subprocess_script.py",
    ),
    Internal(
        "lightning.fabric.strategies.launchers.subprocess_script",
        "_hydra_subprocess_cmd",
        "the same function, imported by name into the Fabric launcher",
        f"{LIGHTNING}/fabric/strategies/launchers/subprocess_script.py",
    ),
    Internal(
        "lightning.pytorch.strategies.launchers.subprocess_script",
        "_launch_process_observer",
        "Lightning's observer SIGKILLs rank 0 without a word when a rank dies; faults.watch_ranks replaces it",
        f"{LIGHTNING}/pytorch/strategies/launchers/subprocess_script.py",
    ),
    Internal(
        "lightning.pytorch.strategies.deepspeed",
        "DeepSpeedStrategy._init_config_if_needed",
        "whether optimizer offload is on is known only once Lightning has formatted the DeepSpeed config",
        f"{LIGHTNING}/pytorch/strategies/deepspeed.py",
    ),
    Internal(
        "lightning.pytorch.strategies.model_parallel",
        "ModelParallelStrategy._data_parallel_size",
        "Lightning sets the data-parallel size to the node count on 'auto'; FSDP shards over all ranks",
        f"{LIGHTNING}/pytorch/strategies/model_parallel.py",
    ),
    Internal(
        "lightning.pytorch.callbacks.model_checkpoint",
        "ModelCheckpoint._save_last_checkpoint",
        "LastCheckpoint saves last.ckpt every N steps and/or every T (Lightning takes one of them)",
        f"{LIGHTNING}/pytorch/callbacks/model_checkpoint.py",
    ),
    Internal(
        "lightning.pytorch.callbacks.model_checkpoint",
        "ModelCheckpoint._should_skip_saving_checkpoint",
        "LastCheckpoint skips what ModelCheckpoint skips (fast_dev_run, a step saved already)",
        f"{LIGHTNING}/pytorch/callbacks/model_checkpoint.py",
    ),
    Internal(
        "lightning.pytorch.callbacks.model_checkpoint",
        "ModelCheckpoint._monitor_candidates",
        "the metrics LastCheckpoint's file name may use, as ModelCheckpoint gathers them",
        f"{LIGHTNING}/pytorch/callbacks/model_checkpoint.py",
    ),
    Internal(
        "lightning.pytorch.loggers.csv_logs",
        "ExperimentWriter._rewrite_with_new_header",
        "Lightning's CSV writer drops the columns it did not log itself; AppendingCSVLogger keeps the history",
        f"{LIGHTNING}/fabric/loggers/csv_logs.py",
    ),
    Internal(
        "lightning.pytorch.loggers.csv_logs",
        "ExperimentWriter._check_log_dir_exists",
        "Lightning's CSV writer deletes an existing metrics.csv; AppendingCSVLogger appends to it",
        f"{LIGHTNING}/fabric/loggers/csv_logs.py",
    ),
    Internal(
        "torch.distributed.checkpoint.default_planner",
        "_EmptyStateDictLoadPlanner",
        "reads a whole DCP folder without knowing its keys (torch's own dcp_to_torch_save uses it)",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/checkpoint/format_utils.py",
    ),
    Internal(
        "torch.distributed.checkpoint.state_dict_loader",
        "_load_state_dict",
        "the load that fills an empty state dict with everything (dcp.load only fills the keys it is given)",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/checkpoint/format_utils.py",
    ),
    Internal(
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        "a type inside DCP's .metadata pickle: allow-listed for weights-only reading",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/checkpoint/filesystem.py",
    ),
    Internal(
        "torch.distributed.checkpoint.metadata",
        "_MEM_FORMAT_ENCODING",
        "a type inside DCP's .metadata pickle: allow-listed for weights-only reading",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/checkpoint/metadata.py",
    ),
    Internal(
        "torch.serialization",
        "_get_layout",
        "rebuilds a torch.layout inside DCP's .metadata pickle: allow-listed for weights-only reading",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/serialization.py",
    ),
]
DEEPSPEED_INTERNALS = [
    Internal(
        "deepspeed.runtime.zero.stage_1_and_2",
        "DeepSpeedZeroOptimizer.clip_grad",
        "ZeRO-1/2 restore the gradient clipping of the run that wrote a checkpoint over the running config's",
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/runtime/zero/stage_1_and_2.py",
    ),
    Internal(
        "deepspeed.comm.comm",
        "cdb",
        "DeepSpeed caches its process groups here; a sweep's next job must not reuse the finished job's",
        "https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/comm/comm.py",
    ),
]


def _lookup(internal: Internal) -> None:
    """Raises if the internal is gone: a module or class attribute, or an instance attribute that the class's
    source assigns (`self.<name> =`)."""
    obj = importlib.import_module(internal.module)
    parts = internal.name.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part) and i == len(parts) - 1 and isinstance(obj, type):
            if f"self.{part} =" not in inspect.getsource(obj):
                raise AttributeError(part)
            return
        obj = getattr(obj, part)


def check_internals(deepspeed: bool = False) -> None:
    """One line if an installed library lacks an internal parallama relies on (see INTERNALS)."""
    for internal in INTERNALS + (DEEPSPEED_INTERNALS if deepspeed else []):
        try:
            _lookup(internal)
        except (ImportError, AttributeError):
            package = internal.module.split(".")[0]
            installed = importlib.metadata.version(package)
            raise ConfigError(
                f"{package} {installed} has no {internal.module}.{internal.name}, which parallama needs "
                f"({internal.why}); install {package}=={TESTED[package]} (pyproject.toml's pin) or update "
                f"src/parallama/runtime/compat.py"
            ) from None


# --- the touches themselves -----------------------------------------------------------------------------


def set_sigterm_notifier(trainer, handler) -> None:
    """Lightning registers (and later restores) `_sigterm_notifier_fn` at fit start: make `handler` the one."""
    trainer._signal_connector._sigterm_notifier_fn = handler


def replace_hydra_subprocess_cmd(command_fn) -> None:
    """The command ddp uses to start ranks > 0 under Hydra; both launchers import it by name."""
    from lightning.fabric.strategies.launchers import subprocess_script as fabric_launcher
    from lightning.pytorch.strategies.launchers import subprocess_script as pytorch_launcher

    fabric_launcher._hydra_subprocess_cmd = command_fn
    pytorch_launcher._hydra_subprocess_cmd = command_fn


def disable_process_observer() -> None:
    from lightning.pytorch.strategies.launchers import subprocess_script

    subprocess_script._launch_process_observer = lambda procs: None


def launched_processes(strategy) -> list:
    """The Popen objects of the ranks this process started (`launcher.procs`, public but undocumented)."""
    return getattr(getattr(strategy, "launcher", None), "procs", [])


def deepspeed_config(strategy) -> dict:
    strategy._init_config_if_needed()
    return strategy.config


def use_all_ranks_for_data_parallel(strategy) -> None:
    strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes


def keep_configured_gradient_clipping(engine) -> None:
    """After DeepSpeed loads a ZeRO-1/2 checkpoint: clip as this run is configured (`trainer.gradient_clip_val`),
    not as the writer was. DeepSpeed restores `clip_grad` from the checkpoint (`_load_legacy_checkpoint`), so a
    resume that changed the clipping, or a checkpoint written by `parallama-ckpt convert`, would silently clip
    otherwise. ZeRO-3 keeps its configured value."""
    zero = getattr(engine, "optimizer", None)
    if zero is not None and hasattr(zero, "clip_grad"):
        zero.clip_grad = engine.gradient_clipping()


def destroy_deepspeed_groups() -> bool:
    """Close the process group through DeepSpeed when it made it (it also drops the groups it cached)."""
    import sys

    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is None or ds_comm.cdb is None:
        return False
    ds_comm.destroy_process_group()
    return True


def load_whole_dcp(storage_reader) -> dict:
    """Everything in a DCP folder, nested as it was saved, in this one process (as dcp_to_torch_save)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=storage_reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


def dcp_metadata_private_types() -> list:
    import torch
    from torch.distributed.checkpoint import filesystem, metadata

    return [filesystem._StorageInfo, metadata._MEM_FORMAT_ENCODING, torch.serialization._get_layout]


# --- DeepSpeed's ZeRO internals (for parallel/zero_state.py) ------------------------------------------------------------------------------------
# DeepSpeed has no public API for (a) merging anything but the fp32 weights of a checkpoint (its public
# get_fp32_state_dict_from_zero_checkpoint drops the moments on reading), nor (b) for the flat fp32 partitions
# that key its base optimizer's state (needed to create that state before the first step, as DeepSpeed's own
# universal-checkpoint loader does, and to read the step count). Both are here:
# https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/utils/zero_to_fp32.py
# https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed/runtime/base_optimizer.py
#   (load_hp_checkpoint_state_from_checkpoint_dir)


def deepspeed_changed(what: str) -> RuntimeError:
    import deepspeed

    return RuntimeError(
        f"DeepSpeed {deepspeed.__version__}: {what} is not where parallama.runtime.compat expects it "
        "(written for DeepSpeed 0.19); update src/parallama/runtime/compat.py"
    )


def zero_merge(
    zero_to_fp32,
    stage: int,
    world: int,
    flat_groups: list,
    model_states: list,
    paddings,
    include_frozen: bool,
):
    """`flat_groups[rank][k]` (fp32 weights or a moment) -> {name: full tensor}, by zero_to_fp32's merge."""
    try:
        if stage <= 2:
            merged = zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
                world, flat_groups, model_states, not include_frozen, paddings
            )
        else:
            merged = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(
                world, flat_groups, model_states, not include_frozen
            )
        return zero_to_fp32.to_torch_tensor(merged)
    except (AttributeError, TypeError) as err:
        raise deepspeed_changed(f"zero_to_fp32's merge ({err})") from None


def zero_partitions(zero) -> list[tuple[int, Tensor, list]]:
    """A running ZeRO optimizer's (param group index, flat fp32 partition keying the base optimizer's state,
    the module parameters it holds) per flat partition of this rank."""
    try:
        if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3: sub-groups of param groups
            return [
                (zero.sub_group_to_group_id[k], flat, list(zero.fp16_groups[k]))
                for k, flat in enumerate(zero.fp32_partitioned_groups_flat)
            ]
        if hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1/2
            return [
                (i, flat, list(zero.bit16_groups[i]))
                for i, flat in enumerate(zero.single_partition_of_fp32_groups)
            ]
        if hasattr(zero, "fp32_groups_flat_partition"):  # BF16_Optimizer (ZeRO-1 with fp32 grad accumulation)
            return [
                (i, flat, list(zero.bf16_groups[i])) for i, flat in enumerate(zero.fp32_groups_flat_partition)
            ]
    except (AttributeError, KeyError, IndexError):
        pass
    raise deepspeed_changed(f"the flat fp32 partitions of {type(zero).__name__}")
