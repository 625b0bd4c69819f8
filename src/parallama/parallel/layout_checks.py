"""What each dimension of a model_parallel layout needs of the model, the data and the schedule, checked with the
rest of the config before any work (app/checks.py calls `check_layout`): tensor parallelism splits heads, the
MLP and the vocabulary; context parallelism two chunks of each sequence per rank; a pipeline its layers into
stages and its batch into microbatches; and what the model's own parts say they cannot do under the layout
(`layout_refusal`: an attention pattern that context parallel's ring cannot run). Each failure is one line naming
the keys. No torch import but for that last check, and only under cp or tp.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from parallama.distributed.dims import dims_of_config
from parallama.distributed.options import FORWARDS_FIRST, SINGLE_STAGE, V_SHAPED, stages_per_rank
from parallama.distributed.options import SCHEDULES as PIPELINE_SCHEDULES
from parallama.errors import ConfigError
from parallama.models import model_spec


def check_layout(cfg: DictConfig, on_gpu: bool) -> None:
    """The mesh's sizes against the world size (`ParallelDims.resolve`), then what each dimension in use needs."""
    dims, strategy = dims_of_config(cfg), cfg.strategy
    if dims.pp > 1:
        _check_pipeline(cfg, dims.pp)
    if dims.cp > 1:
        _check_context_parallel(cfg, dims)
    if strategy.get("sequence_parallel") and dims.tp == 1:
        raise ConfigError(
            "strategy.sequence_parallel=true needs strategy.tp > 1 (it splits the tp ranks' work)"
        )
    if dims.tp > 1:
        _check_tensor_parallel(cfg, dims.tp)
    if dims.ep > 1:
        _check_expert_parallel(cfg, dims.ep)
    if dims.cp > 1 or dims.tp > 1:  # each attention call sees part of the sequence, or of the heads
        _check_model_parts(cfg, dims)
    if dims.tp > 1 and cfg.compile is True and not on_gpu:  # `auto` is off on CPU
        raise ConfigError(
            "compile=true with strategy.tp > 1 computes wrong gradients on CPU (measured with torch 2.13: "
            "the loss after one step differs from eager's by 2e-2); use compile=false on CPU"
        )


def _check_expert_parallel(cfg: DictConfig, ep: int) -> None:
    """Each ep rank holds num_experts / ep of every block's experts."""
    experts = cfg.model.get("num_experts")
    if experts is None:
        raise ConfigError(
            f"strategy.ep={ep} shards a mixture of experts, but model.family={cfg.model.get('family', 'llama')} "
            "has none (model.num_experts); use strategy.ep=1 or an MoE model (model=qwen3_moe_tiny)"
        )
    if experts % ep:
        raise ConfigError(f"strategy.ep={ep} must divide model.num_experts={experts}")


def _check_pipeline(cfg: DictConfig, pp: int) -> None:
    """The schedule against the stages per rank, the model's layers against the stages, the microbatches against
    the batch and the schedule (torch's own limits, said before any work)."""
    strategy, model = cfg.strategy, cfg.model
    schedule = strategy.pp_schedule
    per_rank = stages_per_rank(schedule, strategy.pp_stages_per_rank)
    several = ", ".join(s for s in PIPELINE_SCHEDULES if s not in SINGLE_STAGE)
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise ConfigError(
            f"strategy.pp_schedule={schedule} runs one stage per rank, but strategy.pp_stages_per_rank={per_rank}; "
            f"set it to 1 or use a schedule for several ({several})"
        )
    if schedule in V_SHAPED and per_rank != 2:
        raise ConfigError(
            f"strategy.pp_schedule={schedule} places exactly 2 stages on each rank (a V), but "
            f"strategy.pp_stages_per_rank={per_rank}; set it to 2"
        )
    if schedule not in SINGLE_STAGE and per_rank < 2:
        raise ConfigError(
            f"strategy.pp_schedule={schedule} needs strategy.pp_stages_per_rank >= 2 (it is {per_rank}; null "
            "is 2 for it), or use gpipe or 1f1b"
        )
    stages = pp * per_rank
    if model.num_hidden_layers < stages:
        raise ConfigError(
            f"strategy.pp={pp} x strategy.pp_stages_per_rank={per_rank} = {stages} pipeline stages, but "
            f"model.num_hidden_layers={model.num_hidden_layers}; each stage needs at least one layer"
        )
    if model.get("tie_word_embeddings"):
        raise ConfigError(
            "model.tie_word_embeddings=true shares the embedding (first stage) with lm_head (last stage); "
            "set it false for strategy.pp > 1"
        )
    if not strategy.get("save_distributed_checkpoint", True):
        raise ConfigError(
            "strategy.save_distributed_checkpoint=false writes one file from rank 0, which holds only its own "
            "pipeline stages; set it true for strategy.pp > 1"
        )
    microbatches, batch = strategy.pp_microbatches or stages, cfg.data.batch_size
    name = f"strategy.pp_microbatches={microbatches}" + ("" if strategy.pp_microbatches else " (the default)")
    if batch % microbatches:
        raise ConfigError(
            f"{name} must divide data.batch_size={batch} (each microbatch is a slice of the rank's batch)"
        )
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(f"{name}: strategy.pp_schedule=1f1b needs at least strategy.pp={pp} microbatches")
    if schedule == "dualpipev" and microbatches < stages:
        raise ConfigError(
            f"{name}: strategy.pp_schedule=dualpipev needs at least {stages} (the stages) microbatches"
        )
    rounds = max(1, microbatches // pp)
    if schedule not in SINGLE_STAGE + V_SHAPED and microbatches % rounds:
        raise ConfigError(
            f"{name}: strategy.pp_schedule={schedule} needs a multiple of {rounds} microbatches "
            f"(microbatches // strategy.pp rounds); e.g. {pp * rounds}"
        )
    coef = model.get("router_aux_loss_coef")
    if coef and microbatches > 1 and schedule not in FORWARDS_FIRST:
        raise ConfigError(
            f"model.router_aux_loss_coef={coef} balances the experts over the step's global batch, which "
            f"strategy.pp_schedule={schedule} has not routed before its first backward ({name}): use "
            "strategy.pp_schedule=gpipe, or loss-free balancing (model.router_aux_loss_coef=0 "
            "model.router_bias_update_rate=0.001)"
        )


def _check_context_parallel(cfg: DictConfig, dims) -> None:
    """Each cp rank holds two of 2 x cp equal chunks of a sample (torch's load balancing), and attention is plain
    causal ring attention (no document mask)."""
    seq_len, cp = cfg.data.seq_len, dims.cp
    if seq_len % (2 * cp):
        raise ConfigError(
            f"strategy.cp={cp} needs data.seq_len divisible by 2 x cp = {2 * cp} (each cp rank takes two equal "
            f"chunks of the sequence), but data.seq_len={seq_len}"
        )
    if cfg.data.get("document_mask"):
        raise ConfigError(
            "strategy.cp > 1 runs causal ring attention, which takes no document mask: set data.document_mask=false"
        )
    if cfg.strategy.get("sequence_parallel") and (seq_len // cp) % dims.tp:
        raise ConfigError(
            f"strategy.sequence_parallel=true with strategy.cp={cp} splits each cp rank's {seq_len // cp} tokens "
            f"over strategy.tp={dims.tp}: make data.seq_len a multiple of cp x tp = {cp * dims.tp}"
        )


def _check_model_parts(cfg: DictConfig, dims) -> None:
    """A part of the model that has rules for a layout says so itself: each module with a `layout_refusal(dims)`
    (models/llama/model.py `Attention`: a pattern of its own under cp) is asked, on the model built on the meta
    device (no memory, no weights), before any rank starts."""
    import torch  # torch-free module

    fields = OmegaConf.to_container(cfg.model, resolve=True)
    fields["vocab_size"] = fields.get("vocab_size") or 64  # filled in from the tokenizer later: any size does
    spec = model_spec(fields)
    with torch.device("meta"):
        model = spec.model(spec.build_config(fields))
    for module in model.modules():
        refusal = getattr(module, "layout_refusal", None)
        if refusal is not None and (line := refusal(dims)):
            raise ConfigError(line)


def _check_tensor_parallel(cfg: DictConfig, tp: int) -> None:
    """Each tp rank holds whole heads (query and key/value: GQA), 1/tp of the MLP and of the vocabulary."""
    model = cfg.model
    heads = model.num_attention_heads
    splits = {
        "model.num_attention_heads": heads,
        "model.num_key_value_heads": model.get("num_key_value_heads") or heads,
        "model.intermediate_size": model.intermediate_size,
    }
    if model.vocab_size is not None:
        splits["model.vocab_size"] = model.vocab_size
    elif 64 % tp:
        raise ConfigError(
            f"strategy.tp={tp} must divide the vocabulary, and model.vocab_size=null is the tokenizer's size "
            f"rounded up to a multiple of 64; set model.vocab_size to a multiple of {tp} (or use a tp dividing 64)"
        )
    if cfg.strategy.get("sequence_parallel"):
        splits["data.seq_len"] = cfg.data.seq_len
    for key, size in splits.items():
        if size % tp:
            raise ConfigError(f"strategy.tp={tp} must divide {key}={size} (each tp rank takes 1/tp of it)")
