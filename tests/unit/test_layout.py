"""The layout's own rules (docs/architecture.md): nothing private of another library outside runtime/compat.py,
and the command-line side imports neither torch nor Lightning until a tool runs."""

import ast
import subprocess
import sys
from pathlib import Path

import parallama

SRC = Path(parallama.__file__).parent
LIBRARIES = ("torch", "lightning", "deepspeed", "hydra", "omegaconf", "transformers", "wandb", "datasets")


def private_uses(path: Path) -> list[str]:
    """`from <library> import _x`, `<library>...._x`, and `x._y` on anything but self/cls (private attributes of
    objects a library made); parallama's own modules name their privates without an attribute access."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            found += [f"import {a.name}" for a in node.names if a.name.startswith("_")]
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls", "os")):  # os._exit is public
                found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_nothing_private_of_another_library_outside_compat():
    offenders = {
        str(path.relative_to(SRC)): uses
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "compat.py" and (uses := private_uses(path))
    }
    assert offenders == {}


def test_the_command_line_side_loads_neither_torch_nor_lightning():
    tools = ["train", "prepare", "evaluate", "export", "generate", "plan", "ckpt"]
    code = "; ".join(f"import parallama.cli.{t}" for t in tools) + "; import parallama.app.checks"
    code += "; import sys; print(sorted(m for m in ('torch', 'lightning', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
