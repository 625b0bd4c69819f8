"""float8 (torchao tensorwise, emulated on CPU) under every strategy group, weights after 3 steps read through
parallama-export (plain weights under the plain names):

- model_parallel tp=2 (torchao's float8 tensor-parallel styles; the same batch and, through DTensor, the same
  tensor-wide scales as one process) ends with the one-process float8 run's weights up to float8's rounding of
  a few elements whose fp32 inputs differ in the last bit (the row-parallel sums' order): max 1e-4 and at most
  0.1% of the elements beyond 1e-5 (seen: max 3.7e-5, 0.02%; float8 vs fp32 training: max 1.4e-3, 35%).
- fsdp on 2 ranks (weights all-gathered in float8, their scales precomputed after each step) ends with ddp's
  2-rank float8 weights (1e-5). Neither equals one process: dynamic scaling takes each rank's amax of its own
  activations and gradients (half the batch), so the roundings differ (seen: mean 1.6e-5 from one process,
  where float8 vs fp32 is 2.4e-5) as they do under torchtitan's data parallelism.
- the fsdp float8 checkpoint (plain tensors, distributed/float8.py `plain_tensors`) resumes for one more step.
- the tp run and the fsdp resume sample text at the end (generation runs under no_grad: torchao's float8
  tensor-parallel inputs and FSDP2's float8 all-gather weights fail under inference mode).
"""

from __future__ import annotations

import pytest
import torch
from conftest import train
from safetensors.torch import load_file

from parallama.cli.export import main as export_hf

pytestmark = pytest.mark.multiprocess

COMMON = [
    "scheduler=constant",
    "optimizer.lr=3e-4",
    "trainer.precision=32-true",
    "seed=7",
    "trainer.limit_val_batches=0",
    "validate_before_training=false",
    "sample.max_new_tokens=0",
]
SAMPLE = "sample.max_new_tokens=4"  # the end-of-run sample, over float8 linears
LAYOUTS = {  # name: (ranks, per-rank batch, overrides)
    "auto": (1, 8, ["float8=tensorwise", "float8_filter=all"]),
    "ddp": (2, 4, ["float8=tensorwise", "float8_filter=all", "strategy=ddp"]),
    "fsdp": (2, 4, ["float8=tensorwise", "float8_filter=all", "strategy=fsdp"]),
    "tp": (
        2,
        8,
        ["float8=tensorwise", "float8_filter=all", "strategy=model_parallel", "strategy.tp=2", SAMPLE],
    ),  # FullLogits
}


def export(run, out: str = "hf") -> dict:
    export_hf([f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"out_dir={run / out}"])
    return load_file(run / out / "model.safetensors")


@pytest.fixture(scope="module")
def weights(tmp_path_factory, data_cache) -> dict:
    tmp = tmp_path_factory.mktemp("float8")
    out = {}
    for layout, (ranks, batch, args) in LAYOUTS.items():
        run = tmp / layout
        common = [*COMMON, *args, f"trainer.devices={ranks}", f"data.batch_size={batch}"]
        train(*common, "trainer.max_steps=3", cwd=tmp, cache=data_cache, run_dir=run, timeout=600)
        out[layout] = export(run)
        if layout == "fsdp":  # resume the float8 checkpoint for 1 more step (the same run directory)
            train(
                *common,
                "trainer.max_steps=4",
                "ckpt_path=last",
                SAMPLE,
                cwd=tmp,
                cache=data_cache,
                run_dir=run,
            )
            out["fsdp_resumed"] = export(run, "hf_resumed")
    return out


def test_float8_tensor_parallel_trains_as_one_process(weights):
    actual, expected = weights["tp"], weights["auto"]
    assert actual.keys() == expected.keys()
    diff = torch.cat([(actual[k] - expected[k]).abs().flatten() for k in expected])
    assert diff.max() < 1e-4 and (diff > 1e-5).float().mean() < 1e-3, (
        diff.max(),
        (diff > 1e-5).float().mean(),
    )


def test_float8_fsdp_trains_as_ddp_and_resumes(weights):
    actual, expected = weights["fsdp"], weights["ddp"]
    assert actual.keys() == expected.keys() == weights["auto"].keys()
    # the HF folder holds the plain model's tensors: its names, fp32, none of torchao's (scales, float8 data)
    assert "model.layers.0.mlp.gate_proj.weight" in actual and "lm_head.weight" in actual
    assert all(k.endswith(".weight") and v.dtype == torch.float32 for k, v in actual.items())
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)
    resumed = weights["fsdp_resumed"]
    assert max((resumed[k] - actual[k]).abs().max().item() for k in actual) > 0  # one more step
