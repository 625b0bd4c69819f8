"""N-D layouts for parallama-plan: the per-GPU memory of `strategy=model_parallel` at given sizes (dp_replicate,
dp_shard, tp, pp, cp), and the search for the first layout that fits.

What each dimension divides (states in `memory.state_bytes`' fsdp engine: fp32 params, grads and AdamW moments,
bf16 compute copies):
- tp: the block matmuls (q/k/v/o, gate/up/down) and, vocab-parallel, the embedding and the head; never the
  norms (a family's per-head q/k norms included). Activations inside attention and the MLP (rotated q, k, v, attention output, gate/up and their product)
  and the logits (the loss is vocab-parallel). Sequence parallel adds the residual stream (the norms' inputs);
  the inputs of the q/k/v and gate/up projections are all-gathered and saved whole (DTensor's
  `PrepareModuleInput`, not Megatron's re-gather in backward), so they are never divided.
- pp: a stage holds ceil(layers / pp) blocks and the embedding (first stage) or the final norm and head (last);
  the heaviest is counted. Activations: the first stage keeps every micro-batch in flight (GPipe: all
  `pp_microbatches`; 1F1B and ZB-V: up to pp of them; interleaved 1F1B and interleaved zero-bubble: 1 + (pp-1)/(pp x
  stages per rank) times that; DualPipeV: pp + 1). The zero-bubble schedules keep the stage's parameters gathered.
- cp: the tokens of each sample (all activations), and, FSDP running over dp_shard x cp, the states too.
- dp_shard (x cp): FSDP shards what a rank holds after tp and pp; dp_replicate does not divide anything.
- ep (a mixture of experts, borrowed from dp_shard): E/ep experts FSDP-sharded over dp_shard / ep, the same
  share of the states; the working set gathers E/ep of a block's experts; one block's all-to-all buffers
  (memory.moe_activation_bytes). Tried largest first with every layout (`expert_parallel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from parallama.distributed.dims import ParallelDims
from parallama.distributed.options import ZERO_BUBBLE
from parallama.parallel.memory import (
    FP32,
    FUSED_LOSS_CHUNK,
    Estimate,
    activation_bytes,
    moe_activation_bytes,
    sparse_blocks,
    state_bytes,
    with_layers,
)


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None  # None: one per stage (strategy=model_parallel's default)
    pp_stages_per_rank: int = 1

    @property
    def microbatches(self) -> int:
        return self.pp_microbatches or self.dims.pp

    def overrides(self) -> list[str]:
        """The parallama-train overrides of this layout (sizes that are not the defaults)."""
        out = ["strategy=model_parallel"]
        out += [f"strategy.{k}={v}" for k, v in self.dims.sizes().items() if v != 1 or k == "dp_shard"]
        out += ["strategy.sequence_parallel=true"] if self.sequence_parallel else []
        if self.dims.pp > 1:
            out += [f"strategy.pp_schedule={self.pp_schedule}"]
        return out

    def describe(self) -> str:
        sizes = " x ".join(f"{k}={v}" for k, v in self.dims.sizes().items() if v > 1) or "1 rank"
        return sizes + (" + SP" if self.sequence_parallel else "")


def _block(c, tp: int) -> tuple[int, int]:
    """Parameters of one decoder block a tp rank holds: (the matmuls' share, the norms), as the family's config
    counts them (`block_params`: a family's head_dim and extra norms included). A mixture of experts
    (`moe_params`: router and experts) is whole on every tp rank."""
    matmuls, norms = c.block_params()
    moe = c.moe_params() if hasattr(c, "moe_params") else 0
    return (matmuls - moe) // tp + moe, norms


def _gathered_experts_saved(c, ep: int) -> int:
    """Parameters of one sparse block's experts that an ep rank does not gather (it holds E/ep of them)."""
    if ep == 1 or not hasattr(c, "moe_params"):
        return 0
    experts = c.moe_params() - c.num_experts * c.hidden_size  # the router is everyone's
    return experts - experts // ep


def expert_padding(c, dims: ParallelDims) -> int:
    """Parameters FSDP2's padding adds to a rank's share of the experts on the heaviest stage: it shards a
    block's stacked experts (E/ep of them under ep) on the expert dimension over dp_shard / ep (x cp) ranks, so
    a rank holds ceil(E/ep / those ranks) experts where E / (dp_shard x cp) are counted (more ranks than
    experts: some hold a padded one, e.g. Qwen3-30B-A3B's 128 over 256 ranks)."""
    if not hasattr(c, "num_experts"):
        return 0
    ranks, local = dims.dp_shard // dims.ep * dims.cp, c.num_experts // dims.ep
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size
    stage = with_layers(c, math.ceil(c.num_hidden_layers / dims.pp))
    return sparse_blocks(stage) * per_expert * (-(-local // ranks) * ranks - local) // ranks


def _root(c, dims: ParallelDims) -> int:
    """The embedding, final norm and head a tp rank holds on the heaviest stage (the last, with pp > 1)."""
    table = c.vocab_size * c.hidden_size // dims.tp  # vocab-parallel embedding and head
    tables = 1 if dims.pp > 1 or c.tie_word_embeddings else 2
    return tables * table + c.hidden_size


def stage_params(c, dims: ParallelDims) -> int:
    """Parameters of the heaviest pipeline stage, as one tp rank holds them (before FSDP shards them)."""
    matmuls, norms = _block(c, dims.tp)
    return math.ceil(c.num_hidden_layers / dims.pp) * (matmuls + norms) + _root(c, dims)


def in_flight(layout: Layout) -> float:
    """How many micro-batches' activations the first pipeline stage holds at its peak."""
    pp, n = layout.dims.pp, layout.microbatches
    if pp == 1 or layout.pp_schedule == "gpipe":
        return n
    if layout.pp_schedule in ("interleaved_1f1b", "interleaved_zb"):
        return min(pp, n) * (1 + (pp - 1) / (pp * layout.pp_stages_per_rank))
    if layout.pp_schedule == "dualpipev":  # one more than ZB-V's, for the overlapped forward and backward
        return min(pp + 1, n)
    return min(pp, n)  # 1f1b; zbv (its two chunks together hold 1F1B's peak)


def estimate_layout(
    c,
    layout: Layout,
    *,
    seq_len: int,
    micro_batch: int,
    precision: str,
    activation_checkpointing,
    float8: str | None = None,
    float8_share: float = 1.0,
    optimizer: str = "adamw",
    loss_impl: str = "plain",
    loss_chunk: int = FUSED_LOSS_CHUNK,
) -> Estimate:
    """Per-GPU peak of one layout (`micro_batch`: the samples of one data-parallel replica's step); `optimizer`
    `loss_impl` and `loss_chunk` as in `plan.estimate`."""
    dims = layout.dims
    per = state_bytes(precision, "fsdp")
    psi = stage_params(c, dims)
    shard = dims.dp_shard * dims.cp
    padding = expert_padding(c, dims)
    matmuls, norms = _block(c, dims.tp)
    layers = math.ceil(c.num_hidden_layers / dims.pp)
    muon = layers * matmuls * 4 if optimizer == "muon" else 0  # memory.optimizer_state_bytes
    params, grads, optim = (
        -(-(psi * b - (muon if k == 2 else 0)) // shard) + padding * b for k, b in enumerate(per[:3])
    )
    # FSDP's working set, unsharded in the compute dtype: the root and two blocks (as plan's "working"); a
    # zero-bubble schedule keeps the whole stage gathered from forward to backward
    gathered_layers = layers if layout.pp_schedule in ZERO_BUBBLE and dims.pp > 1 else min(2, layers)
    gathered_block = matmuls + norms - _gathered_experts_saved(c, dims.ep)
    gathered = (_root(c, dims) + gathered_layers * gathered_block) * (per[3] or per[0])
    if (
        shard > 1 and float8 == "tensorwise"
    ):  # the blocks' matmul weights gathered in float8 (memory.float8_gathered)
        gathered -= int(gathered_layers * matmuls * float8_share) * ((per[3] or per[0]) - 1)
    e = 4 if precision in FP32 else 2
    tokens = micro_batch * seq_len // (layout.microbatches * dims.cp)
    kwargs = dict(
        tp=dims.tp, sequence_parallel=layout.sequence_parallel, loss_impl=loss_impl, loss_chunk=loss_chunk
    )
    stage = with_layers(c, layers)
    blocks = activation_bytes(stage, tokens, e, e, activation_checkpointing, head=False, **kwargs)
    head = activation_bytes(stage, tokens, e, e, activation_checkpointing, **kwargs) - blocks
    blocks += moe_activation_bytes(stage, tokens, e, activation_checkpointing, tp=dims.tp, ep=dims.ep)
    if dims.pp == 1:
        acts = blocks + head
    else:  # the first stage's micro-batches in flight, or the last stage's one with the head (with
        # checkpointing the recomputed block is counted per micro-batch in flight: an upper bound)
        acts = max(int(in_flight(layout) * blocks), blocks + head)
    return Estimate(params, grads, optim, gathered=gathered, activations=acts)


# Ring attention hides its key/value exchange behind the attention compute only on long enough shards: context
# parallel is considered while each cp rank keeps at least this many tokens of a sample.
MIN_CP_TOKENS = 4096


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(c, *, nodes: int, gpus_per_node: int, seq_len: int, micro_batch: int) -> list[Layout]:
    """Every valid layout of nodes x gpus_per_node GPUs, in the order they are tried: no pipeline before a
    pipeline (it needs micro-batches and idles in its bubble), no context parallel before it (long sequences
    only: `MIN_CP_TOKENS`), the least tensor parallel (within a node, sequence parallel on where it divides),
    and across nodes HSDP (shard within a node, replicate across) before FSDP over every GPU."""
    world, heads = nodes * gpus_per_node, c.num_attention_heads
    splits = (heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size)
    found = []
    for pp in (p for p in divisors(world) if p <= c.num_hidden_layers and micro_batch % p == 0):
        cps = [
            k
            for k in divisors(world // pp)
            if k == 1 or seq_len % (2 * k) == 0 and seq_len // k >= MIN_CP_TOKENS
        ]
        for cp in cps:
            for tp in divisors(world // (pp * cp)):
                if tp > gpus_per_node or gpus_per_node % tp or any(s % tp for s in splits):
                    continue
                rest = world // (pp * cp * tp)
                # HSDP: a node's GPUs hold one replica (shard group x cp x tp), the nodes replicate
                node_replicas = nodes > 1 and pp == 1 and gpus_per_node % (tp * cp) == 0 and rest % nodes == 0
                replicas = [nodes] if node_replicas else []
                for dp_replicate in [*replicas, 1]:
                    dims = ParallelDims(dp_replicate, rest // dp_replicate, cp, tp, pp)
                    sp = tp > 1 and (seq_len // cp) % tp == 0
                    found += [
                        Layout(replace(dims, ep=ep), sp, pipeline_schedule(c, pp))
                        for ep in expert_parallel(c, dims, gpus_per_node)
                    ]
    return sorted(found, key=lambda x: (x.dims.pp, x.dims.cp, x.dims.tp, -x.dims.dp_replicate))


def pipeline_schedule(c, pp: int) -> str:
    """1F1B, or for a mixture of experts balanced by its load-balancing loss gpipe: its balancing counts are the
    step's, which only a schedule that runs every forward first has before backward (parallel/layout_checks.py).
    At the default microbatches (one per stage) gpipe holds as many in flight as 1F1B."""
    return "gpipe" if pp > 1 and getattr(c, "router_aux_loss_coef", 0) else "1f1b"


def expert_parallel(c, dims: ParallelDims, gpus_per_node: int) -> list[int]:
    """The ep sizes a layout is tried with, largest first: for a mixture of experts those that divide dp_shard
    and num_experts with the ep group (ep x tp ranks) inside a node, without cp (ep with cp is not supported);
    [1] for a dense model. The largest ep all-gathers the fewest experts (none at ep = dp_shard): FSDP gathers a
    block's every expert twice a step and reduce-scatters its gradients, where the all-to-alls move 4 top_k h
    values per token (docs/strategies.md)."""
    if not hasattr(c, "num_experts") or dims.cp > 1:
        return [1]
    fit = [
        ep
        for ep in divisors(dims.dp_shard)
        if c.num_experts % ep == 0 and gpus_per_node % (ep * dims.tp) == 0
    ]
    return sorted(fit, reverse=True)


def search(
    c,
    *,
    nodes: int,
    gpus_per_node: int,
    seq_len: int,
    micro_batch: int,
    precision: str,
    gpu_memory_gb: float,
    checkpointing: tuple[bool, ...] = (False, True),
    float8: str | None = None,
    float8_share: float = 1.0,
    optimizer: str = "adamw",
    loss_impl: str = "plain",
    loss_chunk: int = FUSED_LOSS_CHUNK,
) -> tuple[Layout, bool, dict[bool, Estimate]] | tuple[None, None, dict]:
    """The first layout (and activation checkpointing, off before on) that fits, with its estimates for each
    `checkpointing`; else (None, None, {}) and nothing fits."""
    shape = dict(seq_len=seq_len, micro_batch=micro_batch, precision=precision, float8=float8)
    shape.update(float8_share=float8_share)
    shape.update(optimizer=optimizer, loss_impl=loss_impl, loss_chunk=loss_chunk)
    for layout in candidates(
        c, nodes=nodes, gpus_per_node=gpus_per_node, seq_len=seq_len, micro_batch=micro_batch
    ):
        plans = {
            ckpt: estimate_layout(c, layout, activation_checkpointing=ckpt, **shape) for ckpt in checkpointing
        }
        for ckpt in checkpointing:
            if plans[ckpt].fits(gpu_memory_gb):
                return layout, ckpt, plans
    return None, None, {}
