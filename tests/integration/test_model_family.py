"""A second model family is one folder plus one conf file: a family outside parallama (a module on the Python
path, here without Hugging Face conversion) trains, resumes and generates through the registry, and a family
that does not exist, or a conversion it lacks, is one line."""

import textwrap

from conftest import TINY, run_cli

from parallama.checkpoint.formats import client_state
from parallama.errors import ConfigError
from parallama.models import families, model_spec

FAMILY = {
    "__init__.py": """
        from dataclasses import dataclass

        from parallama.models import ModelSpec
        from parallama.models.llama.config import LlamaConfig


        @dataclass
        class ScaledConfig(LlamaConfig):
            embedding_scale: float = 1.0


        SPEC = ModelSpec(
            family="scaled",
            config=ScaledConfig,
            model_path="scaled.model.Scaled",
            parallelize_path="parallama.models.llama.parallelize.parallelize",
        )
    """,
    "model.py": """
        from parallama.models.llama.model import Llama


        class Scaled(Llama):
            '''A Llama whose logits are scaled by `embedding_scale`: other outputs, the same parameters.'''

            def forward(self, input_ids, *args, **kwargs):
                return super().forward(input_ids, *args, **kwargs) * self.config.embedding_scale
    """,
}


def test_a_family_outside_parallama_trains_resumes_and_generates(tmp_path, data_cache):
    package = tmp_path / "scaled"
    package.mkdir()
    for name, text in FAMILY.items():
        (package / name).write_text(textwrap.dedent(text))
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "scaled.yaml").write_text(
        "family: scaled\nvocab_size: null\nhidden_size: 64\nintermediate_size: 128\nnum_hidden_layers: 2\n"
        "num_attention_heads: 4\nnum_key_value_heads: 2\nmax_position_embeddings: 256\nembedding_scale: 0.5\n"
    )
    env = {"PYTHONPATH": str(tmp_path)}
    run = tmp_path / "run"
    args = ["--config-dir", str(tmp_path / "conf"), "model=scaled", *TINY, f"paths.cache_dir={data_cache}"]
    args = [a for a in args if not a.startswith("model.")]
    out = run_cli(
        "parallama.cli.train", *args, "trainer.max_steps=2", f"hydra.run.dir={run}", cwd=tmp_path, env=env
    )
    last = run / "checkpoints" / "last.ckpt"
    assert client_state(last)["hyper_parameters"]["model"]["family"] == "scaled", out.stdout[-2000:]
    run_cli(
        "parallama.cli.train",
        *args,
        "trainer.max_steps=3",
        f"ckpt_path={last}",
        f"hydra.run.dir={run}",
        cwd=tmp_path,
        env=env,
    )
    assert client_state(last)["global_step"] == 3
    text = run_cli(
        "parallama.cli.generate",
        f"ckpt_path={last}",
        "max_new_tokens=4",
        "temperature=0",
        cwd=tmp_path,
        env=env,
    ).stdout
    assert text.strip()
    export = run_cli(
        "parallama.cli.export",
        f"ckpt_path={last}",
        f"out_dir={tmp_path / 'hf'}",
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert export.returncode == 2 and "model.family=scaled has no Hugging Face conversion" in export.stderr


def test_an_unknown_family_is_one_line():
    assert families() == ["llama", "qwen3", "qwen3_moe"]
    try:
        model_spec({"family": "gpt9"})
    except ConfigError as err:
        assert str(err) == (
            "model.family=gpt9 is not a model family; valid: llama, qwen3, qwen3_moe (or the module path of one outside "
            "parallama)"
        )
    else:
        raise AssertionError("no error")
