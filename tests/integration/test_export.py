"""Checkpoints <-> Hugging Face folders: exact logits both ways, tokenizer files, init_from, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from parallama.checkpoint.read import load_checkpoint, load_state_into
from parallama.cli.export import main as export_main
from parallama.errors import ConfigError
from parallama.models.hf_logits import check_init_from
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.hf import load_hf_weights, save_hf_folder
from parallama.models.llama.model import Llama
from parallama.tokenizer import byte_level

BIN = Path(sys.executable).parent
# Matches the byte tokenizer: 260 tokens, rounded up to 320 by parallama-train.
SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,  # HF's default is 1e-6
)


def hf_model(tie=False, seed=0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tie)).eval()


def trained_run(base: Path) -> Path:
    """One tiny parallama-train run, shared by the test files (reused when it exists): it starts from a
    random HF model via init_from, with lr=1e-9 so that its checkpoint still holds those weights."""
    run = base / "run"
    if (run / "checkpoints" / "last.ckpt").exists():
        return run
    hf_model().save_pretrained(base / "hf_init")
    overrides = [f"model.{k}={v}" for k, v in SHAPE.items() if k != "vocab_size"]
    cmd = [str(BIN / "parallama-train"), *overrides, f"init_from={base / 'hf_init'}", "optimizer.lr=1e-9"]
    cmd += ["trainer.accelerator=cpu", "trainer.max_steps=2", "trainer.val_check_interval=2"]
    cmd += ["trainer.limit_val_batches=2", "scheduler.warmup_steps=1", "data.batch_size=2", "data.seq_len=32"]
    cmd += ["data.source.max_documents=12", "sample.max_new_tokens=0", "callbacks.progress_bar=null"]
    cmd += [f"paths.cache_dir={base / 'cache'}", f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=base, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return trained_run(tmp_path_factory.getbasetemp())


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers(tmp_path, tie):
    torch.manual_seed(0)
    ours = Llama(LlamaConfig(**SHAPE, tie_word_embeddings=tie)).eval()
    tok = byte_level()
    save_hf_folder(tmp_path, ours.state_dict(), ours.config, tok.to_str())
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 320, (2, 24))
    torch.testing.assert_close(logits(theirs, ids), logits(ours, ids), atol=1e-5, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Héllo, wörld!\n  def f(x): return x"
    # as training saw every document: BOS first (found: the exported tokenizer added none)
    assert hf_tok(text)["input_ids"] == [hf_tok.bos_token_id, *tok.encode(text).ids]
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text).ids
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == ("[BOT]", "[EOT]", "[PAD]")


@pytest.mark.parametrize("tie", [False, True])
def test_export_of_a_padded_head_writes_the_true_vocabulary(tmp_path, tie):
    """A vocabulary of 300, whose head's matmul runs padded to 320 in training (Llama.logits): the folder holds
    300 rows and says vocab_size=300 (no parallama key), transformers gives the logits of the padded computation,
    and init_from reads it back into a model of any padding."""
    shape = {**SHAPE, "vocab_size": 300}
    torch.manual_seed(0)
    ours = Llama(LlamaConfig(**shape, tie_word_embeddings=tie, pad_vocab_multiple=64))
    save_hf_folder(tmp_path, ours.state_dict(), ours.config, byte_level().to_str())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == 300 and "pad_vocab_multiple" not in config
    rows = {
        k: v.shape[0]
        for k, v in load_file(tmp_path / "model.safetensors").items()
        if "embed" in k or "head" in k
    }
    assert rows == {"model.embed_tokens.weight": 300, **({} if tie else {"lm_head.weight": 300})}
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 300, (2, 24))
    padded = ours(ids)  # gradients on: the padded matmul
    assert padded.shape == (2, 24, 300)
    torch.testing.assert_close(logits(theirs, ids), padded.detach(), atol=1e-5, rtol=0)
    unpadded = Llama(LlamaConfig(**shape, tie_word_embeddings=tie, pad_vocab_multiple=1))
    load_hf_weights(unpadded, tmp_path)
    torch.testing.assert_close(logits(unpadded, ids), padded.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_export_files_follow_the_umask(tmp_path, umask):
    ours = Llama(LlamaConfig(**SHAPE))
    old = os.umask(umask)
    try:
        save_hf_folder(tmp_path, ours.state_dict(), ours.config, byte_level().to_str())
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()}
    assert len(modes) == 6 and set(modes.values()) == {0o666 & ~umask}, modes


@pytest.mark.parametrize(("tie", "shard"), [(False, None), (True, None), (False, "60KB")])
def test_load_hf_weights_matches_transformers(tmp_path, tie, shard):
    theirs = hf_model(tie)
    theirs.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    ours = Llama(LlamaConfig(**SHAPE, tie_word_embeddings=tie)).eval()
    load_hf_weights(ours, tmp_path)
    ids = torch.randint(0, 320, (2, 24))
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), atol=1e-5, rtol=0)


def test_init_from_starts_training_from_the_hf_weights(run, tmp_path):
    """The checkpoint after 2 steps at lr=1e-9 still holds the HF model's weights: init_from was used."""
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    hf = {k.removeprefix("model."): v for k, v in hf_model().state_dict().items()}
    for key, tensor in ckpt.state_dict.items():
        torch.testing.assert_close(tensor, hf[key], atol=1e-6, rtol=0)
    # And the console script exports it to a folder transformers runs with the same logits.
    out = tmp_path / "hf"
    cmd = [str(BIN / "parallama-export"), f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", f"out_dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ours = Llama(ckpt.config).eval()
    load_state_into(ours, ckpt.state_dict)
    ids = torch.randint(0, 320, (1, 16))
    theirs = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(theirs, ids), logits(ours, ids), atol=1e-5, rtol=0)


def test_init_from_of_another_shape(tmp_path):
    hf_model().save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as excinfo:
        load_hf_weights(Llama(LlamaConfig(**{**SHAPE, "hidden_size": 32})), tmp_path)
    one_line(excinfo, f"init_from={tmp_path}", "hidden_size=64", "model.hidden_size=32")


def test_checkpoint_of_another_shape(run):
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    with pytest.raises(ConfigError) as excinfo:
        load_state_into(Llama(LlamaConfig(**{**SHAPE, "intermediate_size": 96})), ckpt.state_dict)
    one_line(excinfo, "layers.0.mlp.gate_proj.weight", "(128, 64)", "(96, 64)")


def test_bad_checkpoints(run, tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        load_checkpoint(tmp_path / "missing.ckpt")
    one_line(excinfo, f"ckpt_path={tmp_path / 'missing.ckpt'} does not exist")

    data = (run / "checkpoints" / "last.ckpt").read_bytes()
    (tmp_path / "half.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError) as excinfo:
        load_checkpoint(tmp_path / "half.ckpt")
    one_line(excinfo, "half.ckpt is truncated or corrupt")

    torch.save({"state_dict": {}, "hyper_parameters": {}}, tmp_path / "other.ckpt")
    with pytest.raises(ConfigError) as excinfo:
        load_checkpoint(tmp_path / "other.ckpt")
    one_line(excinfo, "other.ckpt is not a parallama checkpoint")

    (tmp_path / "folder.ckpt").mkdir()
    with pytest.raises(ConfigError) as excinfo:
        load_checkpoint(tmp_path / "folder.ckpt")
    one_line(excinfo, "folder.ckpt is a folder but neither")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["ckpt_path=x", "out_dir=y", "bogus=1"],
            "unknown or invalid key 'bogus'; valid keys: ckpt_path, out_dir",
        ),
        (["ckpt_path=x"], "out_dir is required but not set"),
        (["ckpt_path"], "'ckpt_path' is not key=value"),
        (
            ["ckpt_path=/nonexistent/last.ckpt", "out_dir=y"],
            "ckpt_path=/nonexistent/last.ckpt does not exist",
        ),
    ],
)
def test_export_cli_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as excinfo:
        export_main(argv)
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


# A family of the test's own: the Llama with a sliding window (a subclass of Attention, no new tensors), exported as
# the Hugging Face architecture its config names: a Llama (which attends to every earlier token) or a Mistral
# (which has the window). Its package is written into the test's folder, as a user's would be on PYTHONPATH.
SLIDING_FAMILY = """
import dataclasses

from parallama.models import ModelSpec
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Attention, DecoderLayer, Llama


@dataclasses.dataclass
class SlidingConfig(LlamaConfig):
    hf_model_type = "{model_type}"
    hf_architecture = "{architecture}"
    sliding_window: int = 16


class SlidingWindowAttention(Attention):
    def __init__(self, config):
        super().__init__(config)
        self.window = config.sliding_window

    def mask_mod(self, b, h, q_idx, kv_idx):
        return super().mask_mod(b, h, q_idx, kv_idx) & (q_idx - kv_idx < self.window)


class SlidingLayer(DecoderLayer):
    attention = SlidingWindowAttention


class SlidingLlama(Llama):
    decoder_layer = SlidingLayer


SPEC = ModelSpec(__name__, SlidingConfig, f"{{__name__}}.SlidingLlama", "parallama.models.llama.parallelize.parallelize",
                 hf_path="parallama.models.llama.hf", hf_model_type="{model_type}")
"""


def checkpoint_of(path: Path, model: torch.nn.Module, family: str, fields: dict) -> Path:
    """A training checkpoint as parallama-train writes one, for the export to read (no run needed)."""
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    model_hparams = {"family": family, **fields}
    torch.save({"state_dict": state, "hyper_parameters": {"model": model_hparams}, "global_step": 7}, path)
    return path


@pytest.mark.parametrize(
    ("model_type", "architecture"), [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM")]
)
def test_a_sliding_window_exports_only_as_an_architecture_that_computes_it(
    tmp_path, monkeypatch, capsys, model_type, architecture
):
    """As a LlamaForCausalLM transformers attends past the window: one line naming the family and the largest
    difference, and no folder. As a MistralForCausalLM (which has the window) the same weights export."""
    family = f"sliding_{model_type}"
    (tmp_path / f"{family}.py").write_text(
        SLIDING_FAMILY.format(model_type=model_type, architecture=architecture)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from parallama.models import model_spec

    fields = {**SHAPE, "sliding_window": 16}
    spec = model_spec({"family": family})
    torch.manual_seed(0)
    model = spec.model(spec.build_config(fields))
    ckpt = checkpoint_of(tmp_path / "last.ckpt", model, family, fields)
    out = tmp_path / "hf"
    argv = [f"ckpt_path={ckpt}", f"out_dir={out}"]
    if model_type == "llama":
        with pytest.raises(SystemExit) as excinfo:
            export_main(argv)
        err = capsys.readouterr().err
        assert excinfo.value.code == 2 and err.count("\n") == 1, err
        assert (
            f"export: transformers' LlamaForCausalLM computes other logits than model.family={family}" in err
        )
        assert "largest difference" in err and "over 128 tokens" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", f"{family}.py"]  # nor a .partial
        # and init_from a Llama's folder into the family: the same check, before any work
        hf_model().save_pretrained(tmp_path / "llama")
        with pytest.raises(ConfigError) as excinfo:
            check_init_from(spec, tmp_path / "llama", {"family": family, **fields})
        one_line(
            excinfo, f"init_from={tmp_path / 'llama'}: transformers' LlamaForCausalLM computes other logits"
        )
        return
    export_main(argv)
    printed = capsys.readouterr().out
    assert "export: transformers' logits equal the model's over 128 tokens" in printed, printed
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "MistralForCausalLM"
    ids = torch.randint(0, 320, (1, 100))
    torch.testing.assert_close(logits(theirs, ids), logits(model.eval(), ids), atol=1e-5, rtol=0)
    assert check_init_from(spec, out, {"family": family, **fields}) is None  # the folder trains the family


@pytest.mark.parametrize("preset", ["tiny", "qwen3_tiny", "qwen3_moe_tiny"])
def test_each_shipped_family_exports_with_its_logits_checked(tmp_path, capsys, preset):
    from omegaconf import OmegaConf

    from parallama import CONF_DIR
    from parallama.models import model_spec

    fields = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{preset}.yaml"), resolve=True)
    fields = {**fields, "vocab_size": 320, "max_position_embeddings": 256}
    spec = model_spec(fields)
    torch.manual_seed(0)
    model = spec.model(spec.build_config(fields))
    ckpt = checkpoint_of(tmp_path / "last.ckpt", model, fields.pop("family", "llama"), fields)
    export_main([f"ckpt_path={ckpt}", f"out_dir={tmp_path / 'hf'}"])
    printed = capsys.readouterr().out
    assert "export: transformers' logits equal the model's over 256 tokens" in printed, printed


def test_without_transformers_export_says_it_cannot_verify(tmp_path, monkeypatch, capsys):
    from parallama.models import hf_logits

    monkeypatch.setattr(hf_logits, "transformers_installed", lambda: False)
    torch.manual_seed(0)
    ckpt = checkpoint_of(tmp_path / "last.ckpt", Llama(LlamaConfig(**SHAPE)), "llama", SHAPE)
    export_main([f"ckpt_path={ckpt}", f"out_dir={tmp_path / 'hf'}"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "export: not verified: transformers is not installed, so the folder's logits were not compared with the "
        "model's (pip install 'parallama[export]')"
    )
    assert (tmp_path / "hf" / "model.safetensors").is_file()
