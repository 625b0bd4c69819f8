"""runtime/quiet.py: the third-party warnings that ask nothing of the user are silenced in this process and in the
processes it starts (a spawned rank never runs the command line's set-up)."""

from __future__ import annotations

import subprocess
import sys
import warnings

from parallama.runtime.quiet import quiet_known_warnings

KNOWN = [
    ("The `srun` command is available on your system but is not used. HINT: ...", UserWarning),
    (
        "It is recommended to use `self.log('val/loss', ..., sync_dist=True)` when logging on epoch level",
        UserWarning,
    ),
    ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning),
]


def test_known_warnings_are_silenced_here_and_in_a_child_and_others_are_not(monkeypatch):
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_warnings()
        for message, category in [*KNOWN, ("something of parallama's own", UserWarning)]:
            warnings.warn(message, category, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something of parallama's own"]
    code = "import warnings\n" + "".join(f"warnings.warn({m!r}, {c.__name__})\n" for m, c in KNOWN)
    code += "warnings.warn('a warning of its own')\n"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "a warning of its own" in child.stderr
    assert not any(m.split(" ")[1] in child.stderr for m, _ in KNOWN[:1]) and "sync_dist" not in child.stderr
    assert "all_gather_into_tensor" not in child.stderr
