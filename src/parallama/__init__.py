"""parallama: pretrain Llama-style language models with Lightning + Hydra under any parallelism strategy."""

from pathlib import Path

__version__ = "0.1.0"


def _conf_dir() -> Path:
    """The Hydra configs: shipped as parallama/conf in a regular install, the repository's conf/ in a source
    checkout or an editable install."""
    here = Path(__file__).resolve().parent
    installed = here / "conf"
    return installed if (installed / "train.yaml").is_file() else here.parents[1] / "conf"


CONF_DIR = _conf_dir()
