"""strategy=fsdp with cpu_offload: where Lightning's move to the device leaves each part of the module. The GPU run
itself (train, validate, checkpoint, resume) was checked on an H100 (docs/strategies.md); here the device is the
meta device, so the routing shows on a CPU-only machine."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallama.distributed.blocks import apply_fsdp
from parallama.parallel.strategies.fsdp import FSDP2
from parallama.training.module import CausalLM


@pytest.fixture
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.device_mesh.init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_offloaded_parameters_stay_on_the_cpu_and_the_rest_goes_to_the_device(one_rank, monkeypatch):
    model = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    optimizer = dict(lr=1e-3, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.1, fused=None)
    scheduler = dict(warmup_steps=2, warmup_start_factor=0.1, min_lr_ratio=0.0)
    module = CausalLM(model=model, optimizer=optimizer, scheduler=scheduler)
    module.model = module.spec.model(module.config)
    apply_fsdp(module.model, one_rank, cpu_offload=True)
    monkeypatch.setattr(FSDP2, "root_device", property(lambda self: torch.device("meta")))
    strategy = FSDP2(cpu_offload=True)
    strategy.model = module
    strategy.model_to_device()
    assert {p.to_local().device.type for p in module.model.parameters()} == {"cpu"}
    assert {b.device.type for b in module.model.buffers()} == {"meta"}  # the rotary tables
    assert module.val_loss.mean_value.device.type == "meta"  # the metric's state
