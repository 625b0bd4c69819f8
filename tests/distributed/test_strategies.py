"""Every strategy trains multi-process on CPU (gloo) and ends with the same weights as one process.

2 ranks x micro-batch 4 must equal 1 process x micro-batch 8 (and 1 x 4 with 2 accumulation steps), compared
through `parallama-export`. Each case is its own subprocess: Lightning's ddp re-executes the command line.
"""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch
from conftest import TINY, free_port, train
from safetensors.torch import load_file

from parallama.cli.export import main as export_hf

pytestmark = pytest.mark.multiprocess
STRATEGIES = ["ddp", "ddp_spawn", "ddp_sharded", "deepspeed", "fsdp"]
PARITY = ["trainer.max_steps=3", "trainer.val_check_interval=2", "trainer.precision=32-true", "seed=7"]
# Logging, validation and the end-of-run sample (on in TINY) do not change the weights, so each strategy's parity
# run also covers one combination of them (precision combinations: test_matrix.py).
COMBINATIONS = {
    "ddp": ["logger=many"],
    "ddp_spawn": [],  # the default CSV logger: validate and fit run in two separate spawns
    "ddp_sharded": ["logger=none"],
    "deepspeed": ["logger=[csv,tensorboard]"],
    "fsdp": ["logger=[]", "validate_before_training=false"],
}


def export(ckpt, out_dir, cwd):
    """parallama-export in this process (no multi-process state in it): a subprocess would only add its start."""
    export_hf([f"ckpt_path={ckpt}", f"out_dir={out_dir}"])
    return load_file(out_dir / "model.safetensors")


def assert_same_weights(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)


def logged_steps(run_dir) -> list[int]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return sorted({int(row["step"]) for row in csv.DictReader(f) if row["train/loss"]})


def validated_steps(run_dir) -> list[int]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return sorted({int(row["step"]) for row in csv.DictReader(f) if row["val/loss"]})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """One process, micro-batch 8: what every 2-rank strategy must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    train(*PARITY, "data.batch_size=8", cwd=tmp, cache=data_cache, run_dir=tmp / "run")
    return export(tmp / "run" / "checkpoints" / "last.ckpt", tmp / "hf", tmp)


VARIANTS = {  # id: overrides
    "deepspeed_zero3": ["strategy=deepspeed", "strategy.stage=3"],
    "deepspeed_offload_optimizer": [
        "strategy=deepspeed",
        "strategy.offload_optimizer=true",
    ],  # DeepSpeedCPUAdam
    "fsdp_zero2_checkpointing": [
        "strategy=fsdp",
        "strategy.reshard_after_forward=false",
        "activation_checkpointing=true",
    ],
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_match_one_process_then_resume(strategy, reference, tmp_path, data_cache):
    run = tmp_path / "run"
    args = [*PARITY, *COMBINATIONS[strategy], f"strategy={strategy}", "trainer.devices=2"]
    # ddp as a user's shell starts it: the installed parallama-train, rank 0 and the rank it starts fresh
    # interpreters (not forked, see tests/forkserver.py), so nothing the test's preloaded server imported can
    # hide a missing import, and rank 1 starts from the console script (launch.job_command), not `-m`.
    # DeepSpeed, in an empty extensions folder: its ZeRO training on CPU builds no C++ op (the shared-memory
    # all-reduce it would build, a minute of g++ per environment, serves only its inference: compat.py).
    extensions = tmp_path / "torch_extensions"
    env = {"TORCH_EXTENSIONS_DIR": str(extensions)} if strategy == "deepspeed" else None
    proc = train(
        *args,
        cwd=tmp_path,
        cache=data_cache,
        run_dir=run,
        fresh="parallama-train" if strategy == "ddp" else False,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert "rank 0/2" in out and "\nsample:\n" in out and "Traceback" not in out
    # every rank, a spawned one too, filters what asks nothing of the user (runtime/quiet.py)
    assert "sync_dist=True" not in out and "is available on your system but is not used" not in out, out[
        -3000:
    ]
    assert "final metrics:   {'val/loss'" in out  # validated after the last step (3; the interval is 2)
    assert not extensions.exists() or not any(extensions.iterdir()), sorted(extensions.iterdir())
    if (run / "csv").exists():
        assert validated_steps(run)[-1] == 3  # the validation after the last step (3)
    last = run / "checkpoints" / "last.ckpt"
    weights = export(last, tmp_path / "hf", tmp_path)
    assert_same_weights(weights, reference)

    from transformers import LlamaForCausalLM  # the export is a real Hugging Face model folder

    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.config.num_hidden_layers == 2

    # Native resume under the same strategy and world size: ddp's in test_faults.py (bitwise, after a SIGTERM),
    # fsdp's DCP folder and DeepSpeed's ZeRO folder in test_legacy_checkpoints.py (bitwise); ddp_sharded's here.
    if strategy != "ddp_sharded":
        return
    resumed = tmp_path / "resumed"
    train(
        *PARITY,
        f"strategy={strategy}",
        "trainer.devices=2",
        "trainer.max_steps=5",
        f"ckpt_path={last}",
        cwd=tmp_path,
        cache=data_cache,
        run_dir=resumed,
    )
    assert logged_steps(resumed)[0] >= 4  # continued from step 3, not from scratch
    assert (resumed / "checkpoints" / "last.ckpt").exists()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_too(variant, reference, tmp_path, data_cache):
    """ZeRO-3 (parameters sharded too), optimizer offload, FSDP keeping gathered weights + checkpointing."""
    train(
        *PARITY,
        *VARIANTS[variant],
        "trainer.devices=2",
        cwd=tmp_path,
        cache=data_cache,
        run_dir=tmp_path / "run",
    )
    assert_same_weights(
        export(tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "hf", tmp_path), reference
    )


def test_fsdp_meta_init_trains(tmp_path, data_cache):
    """Meta-device build + per-shard init: for models whose full copy does not fit in host memory."""
    proc = train(
        "strategy=fsdp",
        "strategy.meta_init=true",
        "trainer.devices=2",
        cwd=tmp_path,
        cache=data_cache,
        run_dir=tmp_path / "run",
    )
    metrics = (tmp_path / "run" / "csv" / "metrics.csv").read_text()
    assert "nan" not in metrics and "rank 0/2" in proc.stdout + proc.stderr


def test_gradient_accumulation_matches_a_bigger_batch(reference, tmp_path, data_cache):
    train(
        *PARITY,
        "data.batch_size=4",
        "trainer.accumulate_grad_batches=2",
        cwd=tmp_path,
        cache=data_cache,
        run_dir=tmp_path / "run",
    )
    assert_same_weights(
        export(tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "hf", tmp_path), reference
    )


def test_torchrun_two_nodes_on_localhost(reference, tmp_path, data_cache):
    """Two 'nodes' of one process each, as torchrun launches them on a cluster (gloo over loopback)."""
    port, run = free_port(), tmp_path / "run"
    args = [
        *TINY,
        *PARITY,
        f"paths.cache_dir={data_cache}",
        f"hydra.run.dir={run}",
        "strategy=ddp",
        "trainer.num_nodes=2",
        "trainer.devices=1",
    ]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={rank}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "parallama.cli.train",
                *args,
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out[-4000:]
    assert "rank 0/2" in outputs[0] and "rank 1/2" in outputs[1]
    assert_same_weights(export(run / "checkpoints" / "last.ckpt", tmp_path / "hf", tmp_path), reference)
