"""parallama: pretrain Llama-style language models with Lightning + Hydra under any parallelism strategy."""

__version__ = "0.1.0"
