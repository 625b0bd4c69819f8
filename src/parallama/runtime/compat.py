"""Every private internal of Lightning, torch or DeepSpeed that parallama relies on, each with why, the versions it
was checked against and the public route that would retire it. Nothing private is touched anywhere else.

Private names change without notice between releases. `check_internals()` runs before training and refuses, in
one line naming the installed version, a library that lacks one (or, for a function parallama bypasses, whose
source changed), instead of an AttributeError deep inside a run. tests/unit/test_compat.py runs the same check and
tests/ exercise each internal (DCP reading: test_untrusted; the ZeRO ones: test_zero_state, test_universal_resume;
DeepSpeed on CPU: every deepspeed run).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

from parallama.errors import ConfigError

TESTED = {"lightning": "2.6.6", "torch": "2.13.0", "deepspeed": "0.19.8"}  # pyproject.toml's pins


@dataclass(frozen=True)
class Internal:
    module: str
    names: tuple[str, ...]  # attribute paths inside the module (a.b for a class attribute)
    why: str
    waits_for: str  # the public route that would replace it
    upstream: str
    source_sha: str = ""  # for a function parallama relies on the body of: a digest of its source

    @property
    def package(self) -> str:
        return self.module.split(".")[0]


LIGHTNING = "https://github.com/Lightning-AI/pytorch-lightning/blob/2.6.6/src/lightning"
DEEPSPEED = "https://github.com/deepspeedai/DeepSpeed/blob/v0.19.8/deepspeed"
INTERNALS = [
    Internal(
        "torch.distributed.checkpoint.filesystem",
        ("_StorageInfo",),
        "DCP's `.metadata` is a plain pickle, which torch reads with full pickle: parallama reads it with a "
        "restricted unpickler that allows only the types it holds, among them these private ones (with "
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING and torch.serialization._get_layout)",
        "torch reading `.metadata` weights-only (or a public list of its safe globals)",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/checkpoint/filesystem.py",
    ),
    Internal(
        "lightning.pytorch.strategies.deepspeed",
        ("DeepSpeedStrategy.setup_environment",),
        "Lightning refuses DeepSpeed without CUDA, though DeepSpeed runs on CPU: on CPU parallama runs "
        "DDPStrategy.setup_environment in its place, which is right only while DeepSpeed's adds nothing but the "
        "CUDA check (its source is compared)",
        "DeepSpeedStrategy accepting the CPU accelerator",
        f"{LIGHTNING}/pytorch/strategies/deepspeed.py",
        source_sha="d8046a5e",
    ),
    Internal(
        "torch.distributed.tensor.experimental._context_parallel._attention",
        ("_templated_ring_attention", "_templated_ring_attention_backward", "custom_ops"),
        "context parallel on CPU: torch's ring attention dispatches only the CUDA SDPA kernels (flash, efficient, "
        "cudnn); parallama adds the CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu and its "
        "backward) to the same handler table, run by torch's own ring",
        "torch's context_parallel supporting the CPU SDPA kernel",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/tensor/experimental/_context_parallel/"
        "_attention.py",
    ),
    Internal(
        "torch.distributed.pipelining.schedules",
        (
            "_PipelineScheduleRuntime.pipeline_order_with_comms",
            "_ComputationType.FORWARD",
            "_Action.sub_actions",
        ),
        "evaluating with a V-shaped pipeline schedule (zbv, dualpipev): its eval() fails in torch 2.13 (the two "
        "stages of a rank hand each other the skipped backward's gradients, AssertionError \"can't steal_bwd_input "
        "if this stage doesn't have backward\"); parallama runs the schedule's forward and send/recv actions only",
        "the V-shaped schedules' eval() skipping backward actions",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/pipelining/schedules.py",
    ),
    Internal(
        "lightning.pytorch.loops.progress",
        ("_BatchProgress.is_last_batch", "_ReadyCompletedTracker.ready", "_ProcessedTracker.processed"),
        "the data position (data/position.py) reads how many batches of the epoch Lightning has fetched and "
        "processed (`trainer.fit_loop.epoch_loop.batch_progress`), and on a resume at another global batch size "
        "sets them, and whether the epoch's last batch is reached, to what the new size gives; CausalLM asks the "
        "same whether the run's last batch was just trained",
        "a public count of the epoch's batches on the Trainer (and a way to resume an epoch mid-way)",
        f"{LIGHTNING}/pytorch/loops/progress.py",
    ),
    Internal(
        "torch.distributed.device_mesh",
        ("DeviceMesh._flatten",),
        "FSDP over dp_shard x cp (the cp ranks average their gradients too) needs the two dimensions as one mesh "
        "dimension, as torchtitan flattens them (`dp_shard_cp`)",
        "a public DeviceMesh.flatten",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/device_mesh.py",
    ),
    Internal(
        "torch",
        ("_grouped_mm",),
        "a mixture of experts runs every expert on its tokens in one grouped GEMM (models/moe.py), as torchtitan "
        "does; where it has no kernel for the device and dtype (CUDA below bf16) one matmul per expert instead",
        "a public grouped matmul (torch.nn.functional.grouped_mm)",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/aten/src/ATen/native/native_functions.yaml",
    ),
    Internal(
        "torch._C",
        ("_current_graph_task_id",),
        "a mixture of experts under a pipeline records its router losses once per microbatch: an activation "
        "checkpoint's recomputation (a forward run inside backward) must not record them again (models/moe.py)",
        "a public 'is this forward a checkpoint's recomputation' query in torch.utils.checkpoint",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/autograd/python_engine.cpp",
    ),
    Internal(
        "torch.utils.checkpoint",
        ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode"),
        "per-op selective checkpointing requires the recomputation to run the forward's ops; the experts' own FSDP "
        "hooks under strategy.ep run others, so their call leaves its dispatch modes (models/moe_parallel.py) and is "
        "recomputed whole (with torch.utils._python_dispatch's _disable_current_modes and "
        "_get_current_dispatch_mode_stack)",
        "a public way to exclude a region from selective activation checkpointing's op matching",
        "https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/checkpoint.py",
    ),
]
DEEPSPEED_INTERNALS = [
    Internal(
        "deepspeed.runtime.zero.stage_1_and_2",
        ("DeepSpeedZeroOptimizer.clip_grad",),
        "ZeRO-1/2 restore the gradient clipping of the run that wrote a checkpoint over the running config's",
        "DeepSpeed's load_checkpoint keeping the running engine's gradient_clipping",
        f"{DEEPSPEED}/runtime/zero/stage_1_and_2.py",
    ),
    Internal(
        "deepspeed.utils.zero_to_fp32",
        ("_get_fp32_state_dict_from_zero2_checkpoint", "_get_fp32_state_dict_from_zero3_checkpoint"),
        "reading a ZeRO checkpoint's AdamW moments as full tensors: the public get_fp32_state_dict_from_zero_"
        "checkpoint merges only the fp32 weights, with these merges, which parallama runs on the moments too",
        "a public merge of any flat state (or DeepSpeed's universal checkpoint for ZeRO-1/2/3 and CPU)",
        f"{DEEPSPEED}/utils/zero_to_fp32.py",
    ),
    Internal(
        "deepspeed.runtime.zero.stage_1_and_2",
        ("DeepSpeedZeroOptimizer.single_partition_of_fp32_groups", "DeepSpeedZeroOptimizer.bit16_groups"),
        "the flat fp32 partitions that key a running ZeRO optimizer's AdamW state (ZeRO-3: "
        "fp32_partitioned_groups_flat, fp16_groups, sub_group_to_group_id; BF16_Optimizer: "
        "fp32_groups_flat_partition, bf16_groups): to create that state before the first step and read its "
        "step count when resuming another strategy's checkpoint, as DeepSpeed's own universal loader does",
        "a public API for a running engine's optimizer state by parameter, step count included",
        f"{DEEPSPEED}/runtime/base_optimizer.py",
    ),
    Internal(
        "deepspeed.comm.torch",
        ("build_shm_op",),
        "on CPU DeepSpeed JIT-builds its shared-memory all-reduce (a minute of g++ per environment) for every "
        "run, though only its inference all-reduce calls it; this function skips the build for an op that "
        "deepspeed.ops.__compatible_ops__ calls incompatible, which `skip_deepspeed_shm_comm` sets",
        "a DeepSpeed switch that starts its CPU communication without that op",
        f"{DEEPSPEED}/comm/torch.py",
        source_sha="1b769051",
    ),
]


def _missing(internal: Internal) -> str | None:
    """What is gone or changed of an internal ("has no X" / "has a changed X"), None if all is in place: a module
    or class attribute, an instance attribute that the class's source assigns (`self.<name> =`), or a function
    whose source no longer has the recorded digest."""
    try:
        module = importlib.import_module(internal.module)
    except ImportError:
        return f"has no {internal.module}"
    for name in internal.names:
        obj = module
        parts = name.split(".")
        for i, part in enumerate(parts):
            if hasattr(obj, part):
                obj = getattr(obj, part)
            elif i == len(parts) - 1 and isinstance(obj, type) and f"self.{part} =" in inspect.getsource(obj):
                break
            else:
                return f"has no {internal.module}.{name}"
        if internal.source_sha and source_digest(obj) != internal.source_sha:
            return f"has a changed {internal.module}.{name}"
    return None


def source_digest(obj) -> str:
    source = "\n".join(line.strip() for line in inspect.getsource(obj).splitlines() if line.strip())
    return hashlib.sha256(source.encode()).hexdigest()[:8]


def check_internals(strategy_internals: Sequence[Internal] = ()) -> None:
    """One line if an installed library lacks (or changed) an internal parallama relies on (see INTERNALS), or
    one the run's strategy relies on (its class's `internals`: DeepSpeed's DEEPSPEED_INTERNALS)."""
    for internal in [*INTERNALS, *strategy_internals]:
        if (what := _missing(internal)) is not None:
            package = internal.package
            raise ConfigError(
                f"{package} {importlib.metadata.version(package)} {what}, which parallama relies on "
                f"({internal.why}); install {package}=={TESTED[package]} (pyproject.toml's pin) or update "
                "src/parallama/runtime/compat.py"
            )


# --- the touches themselves -----------------------------------------------------------------------------


def dcp_metadata_private_types() -> list:
    import torch  # torch-free module
    from torch.distributed.checkpoint import filesystem, metadata

    return [filesystem._StorageInfo, metadata._MEM_FORMAT_ENCODING, torch.serialization._get_layout]


def setup_deepspeed_environment_on_cpu(strategy) -> None:
    """DeepSpeedStrategy.setup_environment minus its CUDA check: the DDP setup under it."""
    from lightning.pytorch.strategies import DeepSpeedStrategy  # torch-free module

    super(DeepSpeedStrategy, strategy).setup_environment()


SHM_COMM_OP = "deepspeed_shm_comm"


def skip_deepspeed_shm_comm() -> None:
    """DeepSpeed's CPU backend JIT-builds its shared-memory all-reduce op when its communication starts (~1 min of
    g++ at a new environment's first run; comm/torch.py `build_shm_op`), yet only its inference all-reduce (AutoTP)
    calls that op: ZeRO training never does. Marked incompatible, the op is not built and the backend keeps gloo."""
    import deepspeed.ops  # torch-free module

    compatible = deepspeed.ops.__compatible_ops__
    if SHM_COMM_OP not in compatible:
        raise deepspeed_changed(f"deepspeed.ops.__compatible_ops__[{SHM_COMM_OP!r}]")
    compatible[SHM_COMM_OP] = False


def keep_configured_gradient_clipping(engine) -> None:
    """After DeepSpeed loads a ZeRO-1/2 checkpoint: clip as this run is configured (`trainer.gradient_clip_val`),
    not as the writer was. DeepSpeed restores `clip_grad` from the checkpoint (`_load_legacy_checkpoint`), so a
    resume that changed the clipping, or a checkpoint written by `parallama-ckpt convert`, would silently clip
    otherwise. ZeRO-3 keeps its configured value."""
    zero = getattr(engine, "optimizer", None)
    if zero is not None and hasattr(zero, "clip_grad"):
        zero.clip_grad = engine.gradient_clipping()


# --- DeepSpeed's ZeRO internals (for checkpoint/zero.py) ---------------------------------------------------------


def deepspeed_changed(what: str) -> RuntimeError:
    import deepspeed  # torch-free module

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


# --- context parallel (distributed/context.py) ------------------------------------------------------------------


def batch_progress(trainer):
    """Lightning's count of this epoch's batches (ready, started, processed, completed; is_last_batch)."""
    return trainer.fit_loop.epoch_loop.batch_progress


def flatten_mesh(mesh, dims: tuple[str, ...], name: str):
    """`mesh[dims]` as one dimension called `name` (reachable from the root mesh by that name afterwards)."""
    return mesh[dims]._flatten(name)


def enable_cpu_ring_attention() -> None:
    """Let torch's `context_parallel` run on CPU: the CPU flash-attention kernel, called with DTensor q/k/v
    sharded on the sequence, goes to torch's ring (`_templated_ring_attention`) with that kernel as the local op,
    exactly as the CUDA kernels do. Idempotent; on CUDA nothing calls the CPU kernel."""
    import torch  # torch-free module
    from torch.distributed.tensor import DTensor, Shard  # torch-free module
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    aten = torch.ops.aten
    if aten._scaled_dot_product_flash_attention_for_cpu.default in cp.custom_ops:
        return

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def forward(op_call, args, kwargs):
        query, key, value, *rest = args  # the kernel's schema: q, k, v, dropout_p=0, is_causal=False, *, ...
        dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
        if kwargs.get("attn_mask") is not None:
            raise NotImplementedError("context parallel attention takes no attn_mask (causal only)")
        mesh = query.device_mesh
        out, lse = cp._templated_ring_attention(
            mesh.get_group(),
            2,
            aten._scaled_dot_product_flash_attention_for_cpu,
            *(local(t) for t in (query, key, value)),
            is_causal=is_causal,
            dropout_p=dropout_p,
            scale=kwargs.get("scale"),
        )
        return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (out, lse))

    def backward(op_call, args, kwargs):
        names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        mesh = a["query"].device_mesh
        grads = cp._templated_ring_attention_backward(
            mesh.get_group(),
            2,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out_name="grad_out",
            **{k: local(v) for k, v in a.items() if k != "attn_mask"},
        )
        return tuple(DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in grads)

    cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = forward
    cp.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = backward


# --- pipeline parallel (distributed/pipeline.py) ----------------------------------------------------------------


@contextmanager
def forward_only(schedule):
    """A pipeline schedule (a `_PipelineScheduleRuntime`) that runs only its forward computation and the
    forward sends/receives, and its parameter gathers, while the context lasts: every rank's action list
    filtered alike, so the sends still meet their receives."""
    from torch.distributed.pipelining.schedules import _ComputationType as Action  # torch-free module

    keep = {Action.FORWARD, Action.SEND_F, Action.RECV_F, Action.UNSHARD, Action.RESHARD}

    def forward_actions(actions):
        out = []
        for action in actions:
            if action is None:
                continue
            if action.computation_type == Action.OVERLAP_F_B:  # DualPipeV: a forward and a backward at once
                out += [a for a in action.sub_actions if a.computation_type in keep]
            elif action.computation_type in keep:
                out.append(action)
        return out

    original = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {
        rank: forward_actions(actions) for rank, actions in original.items()
    }
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = original


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Rows of `x` sorted by group, group g (rows offsets[g-1]:offsets[g]) times w[g].T: torch's grouped GEMM in
    bf16 and on CPU (its kernels there), else one matmul per group. Its CPU backward fails on no rows; under
    torch.compile its shape function takes bf16 only (torch 2.13), also where the CPU kernel runs fp32."""
    import torch  # torch-free module

    cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
    if x.shape[0] and (cpu or x.dtype == torch.bfloat16):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    bounds = [0, *offsets.tolist()]
    return torch.cat([x[a:b] @ w[g].T for g, (a, b) in enumerate(zip(bounds, bounds[1:]))])


def recomputing_in_backward() -> bool:
    """Whether this forward runs inside backward: torch's non-reentrant activation checkpoint recomputes from an
    unpack hook, inside the autograd engine's graph task."""
    import torch  # torch-free module

    return torch._C._current_graph_task_id() != -1


@contextmanager
def outside_selective_checkpointing():
    """Run the block outside per-op selective checkpointing's dispatch modes (where they are active),
    which require the recomputation to run the forward's ops: a MoE's experts under expert parallelism (their own
    FSDP hooks, the all-to-alls, the grouped GEMMs; their FSDP state differs in backward, and torch raised
    'profiler._record_function_enter_new.default invocation index 2 encountered during backward but not found').
    The checkpoint's saved-tensor hooks still hold, so the region is recomputed whole, as under full
    checkpointing (the all-to-alls again), the rest of the block per op."""
    # torch-free module
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
    from torch.utils.checkpoint import (  # torch-free module
        _CachedTorchDispatchMode,
        _CachingTorchDispatchMode,
    )

    sac = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
    if any(isinstance(mode, sac) for mode in _get_current_dispatch_mode_stack()):
        with _disable_current_modes():
            yield
    else:
        yield
