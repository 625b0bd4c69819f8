"""parallama: pretrain Llama-style language models with Lightning + Hydra under any parallelism strategy."""

from pathlib import Path

__version__ = "0.1.0"
CONF_DIR = (
    Path(__file__).resolve().parents[2] / "conf"
)  # the Hydra configs (an editable install keeps them here)
