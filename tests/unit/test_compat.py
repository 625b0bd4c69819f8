"""Every private internal parallama relies on is where runtime/compat.py says, and a change is one line."""

from dataclasses import replace

import pytest

from parallama.errors import ConfigError
from parallama.runtime import compat


def test_every_internal_is_where_compat_expects_it():
    compat.check_internals(deepspeed=True)
    internals = compat.INTERNALS + compat.DEEPSPEED_INTERNALS
    assert len(internals) <= 8  # a new one is a decision: say why in compat.py
    assert all(i.why and i.waits_for and i.upstream and i.package in compat.TESTED for i in internals)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"names": ("NoSuchThing",)}, "has no torch.distributed.checkpoint.filesystem.NoSuchThing"),
        (
            {"source_sha": "00000000"},
            "has a changed lightning.pytorch.strategies.deepspeed.DeepSpeedStrategy.setup_environment",
        ),
    ],
)
def test_a_changed_internal_is_refused_in_one_line(monkeypatch, change, message):
    first = compat.INTERNALS[0] if "names" in change else compat.INTERNALS[1]
    monkeypatch.setattr(compat, "INTERNALS", [replace(first, **change)])
    with pytest.raises(ConfigError, match=message) as err:
        compat.check_internals()
    assert "\n" not in str(err.value) and "update src/parallama/runtime/compat.py" in str(err.value)
