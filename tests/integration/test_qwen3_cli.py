"""The second family, end to end in one process: `model=qwen3_tiny` (head_dim 48 != hidden / heads) trains,
`parallama-export` writes a folder that transformers loads as a Qwen3ForCausalLM with our logits, and
`init_from=<that folder>` starts a run from its weights."""

import pytest
import torch
import transformers
from conftest import run_cli, train

from parallama.checkpoint.read import load_checkpoint, load_state_into
from parallama.models.qwen3.model import Qwen3

MODEL = ["model=qwen3_tiny", "sample.max_new_tokens=4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("qwen3")
    train(*MODEL, "trainer.max_steps=2", cwd=tmp, cache=data_cache, run_dir=tmp / "run")
    return tmp


def test_qwen3_trains_exports_to_transformers_and_trains_from_the_export(run, data_cache):
    ckpt = load_checkpoint(run / "run" / "checkpoints" / "last.ckpt")
    assert ckpt.spec.family == "qwen3" and ckpt.config.head_dim == 48 and ckpt.config.hidden_size == 64
    ours = Qwen3(ckpt.config).eval()
    load_state_into(ours, ckpt.state_dict)
    out = run / "hf"
    run_cli(
        "parallama.cli.export",
        f"ckpt_path={run / 'run' / 'checkpoints' / 'last.ckpt'}",
        f"out_dir={out}",
        cwd=run,
    )
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs) is transformers.Qwen3ForCausalLM and theirs.config.head_dim == 48
    ids = torch.randint(0, ckpt.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (theirs(ids).logits - ours(ids)).abs().max().item()
    print(f"qwen3_tiny export: max logits diff vs transformers {diff:.2e}")
    assert diff <= 1e-5, f"logits differ by {diff:.2e}"
    # init_from the export: at lr=1e-9 the new run's checkpoint still holds the folder's weights
    train(
        *MODEL,
        f"init_from={out}",
        "optimizer.lr=1e-9",
        "trainer.max_steps=1",
        "validate_before_training=false",
        cwd=run,
        cache=data_cache,
        run_dir=run / "from_hf",
    )
    again = load_checkpoint(run / "from_hf" / "checkpoints" / "last.ckpt")
    assert again.state_dict.keys() == ckpt.state_dict.keys()
    for key, tensor in ckpt.state_dict.items():
        torch.testing.assert_close(again.state_dict[key], tensor, atol=1e-6, rtol=0, msg=key)
