"""torchtitan 0.2.2's Llama 3 on one GPU, for `python -m bench train-gpu`: 0.2.2 is the release cut against torch
2.11, the GPU machines' torch (0.3 needs `DataParallelMeshDims`, which 2.11's FSDP lacks). Its `Transformer` with
Llama-3.2-1B's widths (0.2.2 ships no 1B flavor: dim 2048, 16 layers, 32 heads / 8 KV heads, its SwiGLU width
rounds to 8192, vocab 128256; untied head, so 262M more parameters to update than parallama's tied 1B, but the same
FLOPs per token), built on the meta device and parallelized by torchtitan's own `parallelize_llama` (its per-op
selective activation checkpointing, compile per block with fullgraph, float8 through its converter with
torchao's `auto_filter_small_kn` and the head kept high precision), with its defaults: SDPA, its compiled plain loss
(`build_cross_entropy_loss`: sum over tokens, divided by the valid ones), bf16 autocast over fp32 weights on one
GPU (`maybe_enable_amp`), fused AdamW, clipping at 1.0. Timed in windows as the parallama arms
(bench/train_gpu.py), and one more step profiled as theirs are (its parts split at its embedding and final norm:
bench/step_time.py `profile_step`). Run as its own process (`python -m bench.titan <json>`): torchtitan needs a process
group, and the GPU's memory is then the arm's alone.

torchtitan is no dependency of parallama: bench/gpu_wheels.sh downloads its pure wheels, bench/gpu_run.sh installs
them offline on the GPU machine. It imports triton, so it does not run on a CPU-only torch.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from bench.step_time import UNPROFILED, clip_and_step, profile_step

SHAPES = {  # torchtitan's TransformerModelArgs of parallama's presets
    "llama3_2_1b": dict(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256
    ),
    "llama3_8b_4l": dict(
        dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
}


def build(shape: str, seq_len: int, batch: int, compile: bool, ac: str, float8: str | None):
    """torchtitan's model parallelized by torchtitan on this process's GPU, its loss and its autocast."""
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import maybe_enable_amp
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
    from torchtitan.protocols.model_converter import build_model_converters

    job = JobConfig()
    job.training.local_batch_size, job.training.seq_len = batch, seq_len
    job.compile.enable, job.compile.components = compile, ["model", "loss"]
    job.activation_checkpoint.mode = ac
    job.activation_checkpoint.selective_ac_option = "op"
    if float8:
        job.model.converters = ["quantize.linear.float8"]
        job.quantize.linear.float8.filter_fqns = ["output", "auto_filter_small_kn"]
        if float8 != "tensorwise":
            job.quantize.linear.float8.recipe_name = float8
    args = TransformerModelArgs(vocab_size=128256, rope_theta=500000, **SHAPES[shape])
    args.update_from_config(job)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    with torch.device("meta"):
        model = Transformer(args)
    converters = build_model_converters(job, dims)
    converters.convert(model)
    model = parallelize_llama(model, dims, job)
    device = torch.device("cuda")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    amp = maybe_enable_amp(dims, job.training.mixed_precision_param, "cuda")
    return model, build_cross_entropy_loss(job), amp, converters, device


def measure(arm: dict) -> dict:
    """tokens/s of `windows` windows of `steps` steps after `warmup` (compilation happens there); peak bytes from
    the end of the warm-up, as the parallama arms reset theirs."""
    model, loss_fn, amp, converters, device = build(
        arm["shape"], arm["seq_len"], arm["batch"], arm["compile"], arm["ac"], arm.get("float8")
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    batch, seq_len = arm["batch"], arm["seq_len"]
    tokens = torch.randint(0, 128256, (batch, seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def train_step(parts=UNPROFILED) -> None:
        with amp:  # torchtitan's forward_backward_step on one GPU
            loss = loss_fn(model(x), y) / y.numel()
        parts.close("head+loss")
        loss.backward()
        clip_and_step(parts, model, opt)
        converters.post_optimizer_hook([model])
        opt.zero_grad(set_to_none=True)

    rates, t0 = [], 0.0
    for step in range(arm["warmup"] + arm["steps"] * arm["windows"] + 1):
        if step >= arm["warmup"] and (step - arm["warmup"]) % arm["steps"] == 0:
            torch.cuda.synchronize(device)
            if step == arm["warmup"]:
                torch.cuda.reset_peak_memory_stats(device)
            else:
                rates.append(arm["steps"] * batch * seq_len / (time.perf_counter() - t0))
            if len(rates) == arm["windows"]:
                break
            t0 = time.perf_counter()
        train_step()
    import torchtitan

    found = {"rates": rates, "peak_bytes": torch.cuda.max_memory_allocated(device)}
    found["torchtitan"] = getattr(torchtitan, "__version__", None)
    if arm.get("profile"):  # where its step's time goes, as the other arms' (never at the cost of the rates)
        try:
            found["profile"] = profile_step(train_step, model, opt, embedding="tok_embeddings")
        except Exception as err:  # noqa: BLE001
            found["profile_error"] = f"{type(err).__name__}: {err}"[:500]
    return found


def main() -> None:
    arm = json.loads(sys.argv[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(arm.get("port", 29517)))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("nccl")
    try:
        print("RESULT " + json.dumps(measure(arm)), flush=True)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
