"""parallama-plan on the command line with a mixture of experts: total and active parameters, FLOPs from the
active ones, and Qwen3-30B-A3B on 8 x 80 GB planned with expert parallelism."""

from conftest import run_cli


def test_qwen3_moe_30b_a3b_on_8_gpus_is_planned_with_expert_parallelism(tmp_path):
    args = ["model=qwen3_moe_30b_a3b", "trainer.devices=8", "data.seq_len=4096", "data.batch_size=1"]
    out = run_cli("parallama.cli.plan", *args, "gpu_memory_gb=80", cwd=tmp_path).stdout
    assert "30.5 B parameters (3.35 B active per token)" in out
    assert "6 x active non-embedding parameters" in out and "dp_shard=8 x ep=8" in out
    assert "Recommendation: model_parallel" in out and "expert parallelism" in out
    assert " strategy=model_parallel strategy.dp_shard=8 strategy.ep=8 " in out
