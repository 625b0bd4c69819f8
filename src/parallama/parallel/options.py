"""What a strategy asks of a model family's parallelize plan (models/<family>/parallelize.py): the plan applies
these to the plain model, in its documented order, and the strategy never touches the model's structure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallama.parallel.dims import ParallelDims


@dataclass(frozen=True)
class FSDPOptions:
    """FSDP2 (`fully_shard`) over the mesh's dp_shard dimension.

    reshard_after_forward: free gathered parameters after each block's forward (ZeRO-3) or keep them until
        backward (False: ZeRO-2, more memory, less communication).
    mixed_precision: None (compute in the parameters' dtype), "bf16" or "fp16": compute in that dtype, reduce
        gradients in fp32, keep fp32 master weights.
    cpu_offload: sharded parameters, gradients and optimizer state live in CPU memory.
    """

    reshard_after_forward: bool = True
    mixed_precision: str | None = None
    cpu_offload: bool = False


@dataclass(frozen=True)
class ParallelizeOptions:
    """sequence_parallel: with dims.tp > 1, norms and the activations between blocks split on the sequence.
    loss_parallel: with dims.tp > 1, the head's logits stay sharded on the vocabulary (the strategy computes
    the loss under `torch.distributed.tensor.parallel.loss_parallel`); False gathers them."""

    dims: ParallelDims
    mesh: Any = None  # torch DeviceMesh over parallel.dims.DIMS; None where the strategy shards by itself
    activation_checkpointing: bool = False
    compile: bool = False
    fsdp: FSDPOptions | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
