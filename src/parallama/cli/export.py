"""`parallama-export ckpt_path=<checkpoint> out_dir=<folder>`: any strategy's checkpoint -> a Hugging Face
folder of the model's family (config.json, model.safetensors, tokenizer files) for transformers, vLLM, llama.cpp, ..."""

from __future__ import annotations

from parallama.checkpoint.read import load_checkpoint
from parallama.cli.keyvalue import parse_cli, run_cli, usage

DEFAULTS = {"ckpt_path": None, "out_dir": None}


def export(argv: list[str] | None = None) -> None:
    cfg = parse_cli(DEFAULTS, argv, required=("ckpt_path", "out_dir"))
    ckpt = load_checkpoint(cfg.ckpt_path)
    ckpt.spec.hf.save_hf_folder(cfg.out_dir, ckpt.state_dict, ckpt.config, ckpt.tokenizer_json)
    note = "" if ckpt.tokenizer_json else " (no tokenizer: the checkpoint predates embedded tokenizers)"
    print(f"exported {cfg.ckpt_path} (step {ckpt.meta.get('global_step', '?')}) to {cfg.out_dir}{note}")


def main(argv: list[str] | None = None) -> None:
    run_cli(export, argv, usage(__doc__, DEFAULTS))


if __name__ == "__main__":
    main()
