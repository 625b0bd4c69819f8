"""The Llama family (Llama 2/3 and the models shaped like them): config.py (LlamaConfig, Hugging Face field
names), model.py (the decoder, read top to bottom), masks.py (attention masks), hf.py (Hugging Face folders) and
parallelize.py (its parallelize plan)."""

from parallama.models import ModelSpec
from parallama.models.llama.config import LlamaConfig

SPEC = ModelSpec(
    family="llama",
    config=LlamaConfig,
    model_path="parallama.models.llama.model.Llama",
    parallelize_path="parallama.models.llama.parallelize.parallelize",
    hf_path="parallama.models.llama.hf",
    hf_model_type="llama",
)
