"""Every private internal parallama relies on is where runtime/compat.py says, and a change is one line."""

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from parallama.errors import ConfigError
from parallama.runtime import compat


def test_every_internal_is_where_compat_expects_it():
    compat.check_internals(compat.DEEPSPEED_INTERNALS)
    internals = compat.INTERNALS + compat.DEEPSPEED_INTERNALS
    assert (
        len(internals) <= 13
    )  # a new one is a decision: say why in compat.py (9th: Lightning's batch progress, 10th: grouped GEMM,
    # 11th-12th: a MoE block's checkpoint recomputation and its experts outside per-op selective checkpointing,
    # 13th: DeepSpeed on CPU without building an op ZeRO never calls)
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


SRC = Path(compat.__file__).resolve().parents[1]
LIBRARIES = ("torch", "lightning", "deepspeed")
# Lightning's loop internals reached through public attributes (trainer.fit_loop): compat.batch_progress
UNDOCUMENTED = {"epoch_loop", "batch_progress"}


def private_uses(tree: ast.AST) -> list[str]:
    """Private names of torch, Lightning or DeepSpeed a module uses: `from torch._x import y`, `import _y`, and an
    attribute `obj._name` on anything but the module's own objects (self, cls), or one of UNDOCUMENTED."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"{node.module}: {p}" for p in parts if p.startswith("_") and not p.startswith("__")]
        elif isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner == "compat":  # compat.batch_progress(...): the one place
                continue
            if (
                private and owner not in ("self", "cls", "os")
            ) or node.attr in UNDOCUMENTED:  # os._exit: public
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_no_private_internal_is_used_outside_compat():
    """runtime/compat.py is the one place for them: a private name of torch, Lightning or DeepSpeed anywhere else
    in src/ fails here (move it into compat.py with its why, versions and public route)."""
    offenders = {}
    for file in SRC.rglob("*.py"):
        if file.name == "compat.py":
            continue
        if uses := private_uses(ast.parse(file.read_text())):
            offenders[str(file.relative_to(SRC))] = uses
    assert offenders == {}


def test_the_guard_sees_each_kind_of_private_use():
    source = """
from torch.distributed.device_mesh import _mesh_resources
from torch._dynamo import config
import lightning
trainer.fit_loop.epoch_loop.batch_progress.current
strategy.precision_plugin._scaler
self._mine, cls._also_mine
"""
    assert sorted(private_uses(ast.parse(source))) == [
        "line 5: .batch_progress",
        "line 5: .epoch_loop",
        "line 6: ._scaler",
        "torch._dynamo: _dynamo",
        "torch.distributed.device_mesh: _mesh_resources",
    ]
