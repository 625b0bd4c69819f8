"""Context parallel on GPUs: torch's ring attention through each CUDA SDPA kernel, and a training step of the Llama
under `parallel.context` (FSDP over dp_shard x cp), each against one rank's full computation.

    torchrun --nproc-per-node 2 -m bench.cp_check              # 2+ GPUs (NCCL): the ring exchanges K/V
    torchrun --nproc-per-node 2 -m bench.cp_check --device cpu # the same checks on CPU (gloo, the CPU kernel)

On CUDA every SDPA kernel torch's ring dispatches (flash, efficient, cudnn; those this GPU runs) is checked in
bf16 with GQA, forward and backward. One GPU can only run cp=1 (NCCL takes one rank per GPU): the kernels go
through the ring's code, but nothing is exchanged. Prints one line per check and exits 1 if any is off.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

from parallama.distributed.context import data_parallel_mesh, mean_loss, sharded_batch, unshard
from parallama.distributed.dims import ParallelDims
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.runtime import compat

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
KERNELS["cudnn"] = SDPBackend.CUDNN_ATTENTION
SMALL = LlamaConfig(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def gathered(mesh, t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(mesh.size())]
    dist.all_gather(parts, t.contiguous(), group=mesh.get_group())
    return unshard(parts, dim)


def attention(mesh, device, dtype, kernel: SDPBackend | None, seq: int, kv_heads: int) -> dict[str, float]:
    """Ring attention of random q (8 heads) and k/v (`kv_heads`) vs SDPA on the whole sequence. On CPU the kernel
    is parallama's registration (distributed/context.py does it when it shards a batch; here by hand)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, seq, 64, generator=g).to(device, dtype) for h in (8, kv_heads, kv_heads))
    out_grad = torch.randn(2, 8, seq, 64, generator=g).to(device, dtype)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    kernels = sdpa_kernel(kernel) if kernel is not None else nullcontext()
    with kernels:
        ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
        ref.backward(out_grad)
        if device.type == "cpu":
            compat.enable_cpu_ring_attention()
        local = [t.clone() for t in (q, k, v, out_grad)]
        with context_parallel(mesh, buffers=local, buffer_seq_dims=[2] * 4, no_restore_buffers=set(local)):
            ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
            out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
            out.backward(local[3])
    diffs = {"out": (gathered(mesh, out.detach(), 2) - ref).abs().max().item()}
    for name, mine, theirs in zip(("dq", "dk", "dv"), (ql, kl, vl), full, strict=True):
        diffs[name] = (gathered(mesh, mine.grad, 2) - theirs.grad).abs().max().item()
    return diffs


def training_step(mesh, dims, device, seq: int) -> dict[str, float]:
    """One forward/backward of the Llama on 2 x seq tokens (fp32 weights, bf16 autocast on CUDA) vs one rank."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref_model = Llama(SMALL).to(device)
    model = Llama(SMALL).to(device)
    model.load_state_dict(ref_model.state_dict())
    dp = data_parallel_mesh(mesh, dims)
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL.vocab_size, (2, seq + 1), generator=g).to(device)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else nullcontext()
    with autocast:
        ref = F.cross_entropy(ref_model(batch["input_ids"]).flatten(0, 1).float(), batch["labels"].flatten())
    ref.backward()
    with sharded_batch(mesh["cp"], batch) as local, autocast:
        logits = model(local["input_ids"], position_ids=local["position_ids"])
        labels = local["labels"].flatten()
        loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels, reduction="sum")
        loss = mean_loss(loss_sum, (labels != -100).sum(), mesh["cp"])
        loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    diff = max((grads[n] - p.grad).abs().max().item() for n, p in ref_model.named_parameters())
    return {"loss": abs(loss.item() - ref.item()), "grad": diff}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cp_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sample (divisible by 2 x ranks)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cp_check: no CUDA device here; run it where one is, or with --device cpu")
        return
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533"
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(cp=world)
    mesh = dims.build_mesh(device.type)
    rows, bad = [], False
    kernels = KERNELS if device.type == "cuda" else {"cpu flash": None}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, kernel in kernels.items():
        for kv_heads in (2, 8):  # GQA, else (a kernel without it) plain multi-head attention
            try:
                diffs = attention(mesh["cp"], device, dtype, kernel, args.seq, kv_heads)
            except RuntimeError as err:  # a kernel this GPU (or these shapes) does not run
                rows.append(
                    f"attention {name}, {kv_heads} kv heads: not run ({str(err).splitlines()[0][:100]})"
                )
                continue
            bad |= max(diffs.values()) > tol
            what = ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
            rows.append(f"attention {name}, {kv_heads} kv heads ({dtype}): {what}")
            break
    step = training_step(mesh, dims, device, args.seq)
    bad |= step["loss"] > (1e-2 if device.type == "cuda" else 1e-5) or step["grad"] > tol
    rows.append(f"Llama step (cp={world}): loss {step['loss']:.2e}, max grad {step['grad']:.2e}")
    if rank == 0:
        print(
            f"context parallel on {world} x {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
        )
        print("\n".join(rows))
        print("OK" if not bad else "OFF: a difference above the tolerance", f"(tolerance {tol:g})")
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
