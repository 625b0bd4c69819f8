"""torchtitan 0.3's Llama 3 on one GPU, for `python -m bench train-gpu`: its model (flavor "1B", Llama-3.2-1B's
shape, as parallama's `model=llama3_2_1b`) built and parallelized by torchtitan's own `parallelize_llama` (compile
per block, its selective or full activation checkpointing, rowwise float8 through its converter (0.3 has no
tensorwise recipe), FSDP2's mixed precision at degree 1), with its defaults: FlexAttention (the mask built per step
from the positions, as its Trainer does), its chunked loss (`ChunkedLossWrapper`); fused AdamW; timed in the same
loop as the bare parallama model (bench/gpu.py's windows). Run as its own process (`python -m bench.titan <json>`):
torchtitan needs a process group, and the GPU's memory is then the arm's alone.

torchtitan is no dependency of parallama: bench/gpu_wheels.sh downloads its pure wheels, bench/gpu_run.sh installs
them offline on the GPU machine. It imports triton, so it does not run on a CPU-only torch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch


def build(flavor: str, seq_len: int, batch: int, compile: bool, ac: str, float8: str | None):
    """torchtitan's model, parallelized by torchtitan, on this process's device; and its loss."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.quantization import Float8LinearConverter
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    converters = None
    if float8:
        emulate = device.type == "cpu"
        if float8 != "rowwise":  # torchtitan 0.3 ships the rowwise recipes only
            raise ValueError(f"float8={float8}: torchtitan 0.3 has rowwise only")
        converters = [Float8LinearConverter.Config(model_compile_enabled=compile, emulate=emulate)]
    spec = model_registry(flavor, converters=converters)  # its default attention: FlexAttention
    ac_config = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[ac]
    config = Trainer.Config(
        model_spec=spec,
        training=TrainingConfig(local_batch_size=batch, seq_len=seq_len),
        parallelism=ParallelismConfig(),
        compile=CompileConfig(enable=compile, components=["model", "loss"] if compile else []),
        activation_checkpoint=ac_config,
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
        ),
    )
    spec.model.update_from_config(config=config)
    dims = ParallelDims.from_config(config.parallelism, world_size=1)
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    with tempfile.TemporaryDirectory() as dump:
        model = spec.parallelize_fn(
            model,
            parallel_dims=dims,
            training=config.training,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=config.activation_checkpoint,
            dump_folder=dump,
        )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True  # noqa: SLF001 - what torchtitan's Trainer sets with its chunked loss
    return model, loss_fn, spec.model.vocab_size, device


def measure(arm: dict) -> dict:
    """tokens/s of `repeats` windows of `steps` steps after `warmup` (compilation happens there), peak bytes."""
    model, loss_fn, vocab, device = build(
        arm["flavor"], arm["seq_len"], arm["batch"], arm["compile"], arm["ac"], arm.get("float8")
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    batch, seq_len = arm["batch"], arm["seq_len"]
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    valid = torch.tensor(y.numel(), device=device)
    positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rates, t0 = [], 0.0
    for step in range(arm["warmup"] + arm["steps"] * arm["repeats"] + 1):
        if step >= arm["warmup"] and (step - arm["warmup"]) % arm["steps"] == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step > arm["warmup"]:
                rates.append(arm["steps"] * batch * seq_len / (time.perf_counter() - t0))
            if len(rates) == arm["repeats"]:
                break
            t0 = time.perf_counter()
        # what torchtitan's Trainer does per step for its FlexAttention: a mask from the tokens' positions (one
        # document per row here: causal)
        masks = model.get_attention_masks(positions=positions)
        loss, _ = loss_fn(model(x, positions=positions, attention_masks=masks), y, valid)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"tokens_per_s": sorted(rates)[len(rates) // 2], "rates": rates, "peak_bytes": peak}


def main() -> None:
    arm = json.loads(sys.argv[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(arm.get("port", 29517)))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend)
    try:
        print("RESULT " + json.dumps(measure(arm)), flush=True)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
