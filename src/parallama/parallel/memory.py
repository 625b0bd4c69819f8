"""The memory model behind parallama-plan: the bytes one GPU holds, term by term, for the fixed strategies
(plan.py) and the N-D layouts (layouts.py) alike; each speed lever is one function here (tests/unit/test_plan_terms.py).

Bytes per parameter (the table in docs/strategies.md): fp32 params 4 + grads 4 + AdamW moments 8 everywhere;
in mixed precision DeepSpeed holds 2 + 2 + 12 (the ZeRO paper's), while ddp/ddp_sharded (Lightning autocast)
hold 4 + 4 + 8 plus bf16 weight copies, and FSDP is planned with its own bf16 policy (4 + 4 + 8 sharded,
bf16 gathered blocks). Sharded states are split over the data-parallel ranks (`ParallelDims.dp_size`).
Activations: Korthikanti et al. adapted to a Llama-style block (`activation_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallama.distributed.options import ACOptions
from parallama.errors import ConfigError

GIB = 2**30
OVERHEAD_GIB = 1.5
HEADROOM = 0.9  # a plan fits when its total is at most 90% of the GPU's memory
# loss.chunk_size's default (training/loss.py CrossEntropy): the fused loss's tokens in flight
FUSED_LOSS_CHUNK = 4096
MIXED, FP32 = ("bf16-mixed", "16-mixed"), ("32-true", "32")


@dataclass(frozen=True)
class Estimate:
    """Peak bytes on one GPU."""

    params: int
    grads: int
    optim: int
    gathered: int  # transient unsharded/low-precision parameter copies
    activations: int
    overhead: int = int(OVERHEAD_GIB * GIB)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim + self.gathered + self.activations + self.overhead

    def fits(self, gpu_memory_gb: float) -> bool:
        return self.total <= HEADROOM * gpu_memory_gb * GIB


def state_bytes(precision: str, engine: str) -> tuple[int, int, int, int]:
    """Bytes per parameter: params, grads, optimizer state, compute copy (0: computes on the params)."""
    if precision in FP32:
        return 4, 4, 8, 0
    if precision not in MIXED:
        raise ConfigError(
            f"trainer.precision={precision} is not planned; use one of {', '.join(MIXED + FP32)}"
        )
    return {"autocast": (4, 4, 8, 2), "deepspeed": (2, 2, 12, 0), "fsdp": (4, 4, 8, 2)}[engine]


def activation_bytes(
    c,
    tokens: int,
    e: int,
    e_res: int,
    checkpointing,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    head: bool = True,
    loss_impl: str = "plain",
    loss_chunk: int = FUSED_LOSS_CHUNK,
) -> int:
    """Saved activations of one micro-batch of `tokens` tokens; e / e_res: bytes of a compute / residual element.

    Per layer and token, Korthikanti et al.'s 34h (GPT, 16-bit, with dropout) becomes, for a Llama block with
    fused (flash) attention, no dropout and a SwiGLU MLP of width i:
    2 norm inputs (residual stream) + q/k/v-projection input h, what attention saves (the config's
    `attention_activations`: rotated q and k, v, attention output; a Qwen3's q/k norm inputs too), MLP input h,
    gate, silu(gate), up and their product 4i. No s^2 term: fused attention saves only the
    log-sum-exp (ignored). With checkpointing only each block's input is kept, plus one block recomputing.

    `checkpointing`: a bool (full / none), a mode, or `parallel.options.ACOptions`. Selective, per-op policy:
    a block keeps its input (residual), the matmuls' and attention's outputs, i.e. q, k, v and the attention
    output (`attention_activations`, split by tp), gate and up (2i / tp), o's and down's outputs (2h, whole):
    `residual + 2 h e + (attention_activations + 2 i) e / tp` per layer (no norm outputs, no silu(gate) and
    product: 1 residual + 2i / tp less than none), plus one block recomputing those (2 h e + 2 i e / tp).
    Selective every_n: `L // n` blocks as full (their input), the others as none, plus one block recomputing.
    The loss adds what `loss_bytes` and `loss_fixed_bytes` say (`loss_impl`: the plain loss's logits, the fused
    one's gradients and its chunk of `loss_chunk` tokens in flight).

    Tensor parallel (`tp`, parallel/layouts.py) divides what lies between a column- and a row-parallel matmul
    (rotated q, k, v, attention output, the MLP's 4i) and the vocab-parallel logits; sequence parallel also
    the residual stream. The projections' inputs (and the head's) are gathered whole under either.
    `head=False`: the blocks only (a pipeline stage without the head).
    """

    ac = ACOptions.of(checkpointing)
    h, i, n = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    residual = h * e_res // (tp if sequence_parallel else 1)
    block = 2 * residual + 2 * h * e + (c.attention_activations() + 4 * i) * e // tp
    if ac.mode == "none":
        layers = n * block
    elif ac.mode == "full":
        layers = n * residual + block
    elif ac.policy == "op":
        kept = residual + 2 * h * e + (c.attention_activations() + 2 * i) * e // tp
        layers = n * kept + 2 * h * e + 2 * i * e // tp
    else:  # every_n
        full = n // ac.every_n
        layers = full * residual + (n - full) * block + (block if full else 0)
    chunk = min(tokens, loss_chunk)
    loss = tokens * loss_bytes(c, e, tp, loss_impl) + loss_fixed_bytes(c, tp, loss_impl, e, chunk)
    return tokens * (layers + (residual + h * e if head else 0)) + (loss if head else 0)


def loss_bytes(c, e: int, tp: int = 1, loss_impl: str = "plain") -> int:
    """Per token, what the loss keeps for backward beyond the head's input. Plain (`loss.impl=plain`): the logits
    (compute dtype), their fp32 copy and the fp32 log-softmax, vocab-parallel under tensor parallel; their
    gradient of the same size replaces them during backward. That is the eager loss's; compiled (`compile`, on
    by default on CUDA, outside tensor parallel, a pipeline and context parallel) it keeps about the logits alone
    (one H100: 3.0 GB at 8192 tokens x 128256, against 12.6 GB eager: docs/benchmarks.md, `loss`), so the plan
    errs on the safe side there. Fused (`loss.impl=fused`, the head's matmul and the cross-entropy in chunks, the
    gradients computed in the forward): no logits, but the hidden states' gradient (fp32, as the final norm's
    output under autocast); the head weight's gradient and the chunk in flight are `loss_fixed_bytes`."""
    if loss_impl == "fused":
        return c.hidden_size * 4
    return c.vocab_size // tp * (e + 4 + (4 if e != 4 else 0))


def loss_fixed_bytes(c, tp: int = 1, loss_impl: str = "plain", e: int = 2, chunk: int = 0) -> int:
    """What the fused loss holds beyond its per-token terms, of its vocab-parallel rows under tensor parallel: the
    fp32 gradient of the head weight, computed in the forward and held until backward, and one chunk of `chunk`
    tokens in flight: its logits (compute dtype) and their fp32 copy, which only the eager pass makes (on CPU and
    under tensor parallel; compiled, on CUDA, it has none), counted always: the plan errs on the safe side."""
    if loss_impl != "fused":
        return 0
    return c.vocab_size // tp * (c.hidden_size * 4 + chunk * (e + (4 if e != 4 else 0)))


def optimizer_state_bytes(c, per_param: int, optimizer: str = "adamw") -> int:
    """The optimizer state of the whole model, unsharded; `per_param`: AdamW's bytes per parameter
    (`state_bytes`). `optimizer=muon` (training/muon.py): Muon keeps one fp32 momentum buffer for the blocks'
    matrices (4 bytes fewer than AdamW's two moments), AdamW the rest (embeddings, head, norms)."""
    total = c.num_params() * per_param
    if optimizer != "muon":
        return total
    matmuls, _ = c.block_params()
    return total - c.num_hidden_layers * matmuls * 4


def optimizer_of(target: str) -> str:
    """`muon` for conf/optimizer/muon.yaml's class (or a subclass named so), else `adamw`: what the plan
    counts."""
    return "muon" if "muon" in target.rsplit(".", 1)[-1].lower() else "adamw"


def with_layers(c, n: int):
    """`c` with `n` blocks (a stage, or one and two blocks); a mixture of experts keeps its dense blocks among
    them (`mlp_only_layers` past `n` dropped)."""
    if hasattr(c, "mlp_only_layers"):
        return replace(c, num_hidden_layers=n, mlp_only_layers=[i for i in c.mlp_only_layers if i < n])
    return replace(c, num_hidden_layers=n)


def sparse_blocks(c) -> int:
    """How many of `c`'s blocks are a mixture of experts (0 for a dense family)."""
    return sum(map(c.is_sparse, range(c.num_hidden_layers))) if hasattr(c, "is_sparse") else 0


def moe_activation_bytes(c, tokens: int, e: int, checkpointing, *, tp: int = 1, ep: int = 1) -> int:
    """What a mixture of experts (models/moe.py) saves beyond the dense MLP `activation_bytes` counts in each of
    its sparse blocks (whose `4 i e / tp` per token it replaces), and the all-to-all buffers of expert parallelism.

    Per token and sparse block, whole on every tp rank: the router's logits and scores in fp32 (2 E x 4) and its
    choices (k int64 experts, k weights, their sum); per copy of the token (k of them) its two int64 indices
    and its weight, the copy going into the experts, its output and its weighted output (index_add_ keeps its
    source): 3 k h e, and the experts' gate, up, silu(gate) and product (4 k i e, i = moe_intermediate_size).
    Full checkpointing: one block recomputing
    that; selective per-op: a block keeps the router's matmul output (E e; torch._grouped_mm is not among the
    saved ops) where the dense one kept gate and up, plus one block recomputing. Under ep (> 1) one block's
    dispatch and combine hold a send and a receive buffer of k h e per token at once (balanced routing: a rank
    receiving c times its share holds c times the receive buffer)."""

    sparse = sparse_blocks(c)
    if not sparse:
        return 0
    k, h, i = c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size
    router = 2 * c.num_experts * 4 + k * (8 + 4) + 4
    moe = router + k * (2 * 8 + e) + (3 * k * h + 4 * k * i) * e
    dense = 4 * c.intermediate_size * e // tp
    ac = ACOptions.of(checkpointing)
    if ac.mode == "none":
        saved = sparse * (moe - dense)
    elif ac.mode == "full":
        saved = moe - dense
    elif ac.policy == "op":
        saved = sparse * (c.num_experts * e - 2 * c.intermediate_size * e // tp) + moe - dense
    else:  # every_n: the blocks not checkpointed as none, plus one recomputing
        kept = sum(c.is_sparse(b) and (b + 1) % ac.every_n for b in range(c.num_hidden_layers))
        saved = kept * (moe - dense) + (moe - dense if c.num_hidden_layers >= ac.every_n else 0)
    buffers = 2 * k * h * e if ep > 1 else 0
    return tokens * (saved + buffers)


def float8_gathered(
    c, how: str, e: int, float8: str | None, blocks: int | None = None, float8_share: float = 1.0
) -> int:
    """Bytes float8 saves in FSDP2's gathered parameters: under the tensorwise recipe the blocks' converted matmul
    weights (`float8_share` of them: distributed/float8.py `converted_share`) are all-gathered in float8 (1 byte, not
    `e`); rowwise gathers them in the high precision (0 saved). The saved activations are unchanged: torchao's
    Float8Linear keeps its input and weight for backward in the high precision and casts them again. `blocks`: how
    many are gathered (default: `how`'s, all or 2)."""
    if float8 != "tensorwise":
        return 0
    matmuls, _ = c.block_params()
    if blocks is None:
        blocks = c.num_hidden_layers if how == "all" else min(2, c.num_hidden_layers)
    return int(blocks * matmuls * float8_share) * (e - 1)
