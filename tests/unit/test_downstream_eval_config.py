"""Bad settings of the downstream evaluation are refused before any work, in one line naming the key."""

import pytest

from parallama import CONF_DIR
from parallama.app.compose import preflight
from parallama.cli import evaluate, train
from parallama.errors import ConfigError

CASES = [  # (tool, overrides, what the one line must say)
    (
        "train",
        ["callbacks.downstream_eval.every_n_steps=0"],
        "callbacks.downstream_eval.every_n_steps=0 is not valid",
    ),
    ("train", ["callbacks.downstream_eval.limit=-5"], "callbacks.downstream_eval.limit=-5 is not valid"),
    (
        "train",
        ["callbacks.downstream_eval.batch_size=0"],
        "callbacks.downstream_eval.batch_size=0 is not valid",
    ),
    ("eval", ["tasks=[parallama_cloze]"], "ckpt_path is required but not set"),
    ("eval", ["model_dir=x"], "model_dir= is for tasks=[...]"),
    ("eval", ["ckpt_path=a", "model_dir=b", "tasks=[parallama_cloze]"], "not both"),
    ("eval", ["ckpt_path=a", "tasks=[parallama_cloze]", "batch_size=0"], "batch_size=0 is not valid"),
    ("eval", ["ckpt_path=a", "tasks=[parallama_cloze]", "limit=0"], "limit=0 is not valid"),
]


@pytest.mark.parametrize("tool, overrides, message", CASES, ids=[" ".join(o) for _, o, _ in CASES])
def test_refused_in_one_line(tool, overrides, message):
    with pytest.raises(ConfigError) as err:
        preflight(CONF_DIR, tool, overrides, {"train": train.check, "eval": evaluate.check}[tool])
    assert message in str(err.value) and "\n" not in str(err.value)
