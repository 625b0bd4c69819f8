"""The layering of docs/architecture.md, held by import-linter (pyproject.toml, `[tool.importlinter]`): each
package imports only those below it, and no package's modules import each other in a circle, imports inside
functions included; and the contracts really fail on an import that runs back up, or round (a copy of the source
with one added)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from hydra.utils import get_object

import parallama.tokenizer
import parallama.training.preemption

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the `parallama` found under `root`/src (the checkout's own, or a copy)."""
    env = {"PYTHONPATH": str(root / "src"), "PATH": str(LINT_IMPORTS.parent)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def test_every_package_imports_only_those_below_it():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 kept, 0 broken" in result.stdout


def test_an_import_that_runs_back_up_breaks_the_contract(tmp_path):
    """The models importing the training package (a function-level import, as the circle of issue #38 was held
    together by): refused, naming both."""
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    contract = tmp_path / "src" / "parallama" / "models" / "contract.py"
    contract.write_text(
        contract.read_text() + "\n\ndef _upward():\n    from parallama.training import loss  # noqa\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "parallama.models is not allowed to import parallama.training" in result.stdout
    assert "parallama.models.contract -> parallama.training.loss" in result.stdout


REASONS = ("torch-free module", "optional dependency", "start-up time")


def test_a_circle_inside_a_package_breaks_the_contract(tmp_path):
    """checkpoint/untrusted.py importing formats.py back (which imports it): the circle that was held together by
    an import inside a function, refused by the `acyclic_siblings` contract, naming the import to remove."""
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    untrusted = tmp_path / "src" / "parallama" / "checkpoint" / "untrusted.py"
    untrusted.write_text(
        untrusted.read_text()
        + "\n\ndef _back():\n    from parallama.checkpoint.formats import detect  # noqa\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "No cycles are allowed in parallama.checkpoint" in result.stdout
    assert ".untrusted -> .formats" in result.stdout


def test_every_import_inside_a_function_says_why():
    """An import is at the top of its module unless it keeps the module light: the CLI's front door answers a bad
    config before torch loads (torch-free module), a dependency only some tools need (optional dependency), or a
    library only one path uses (start-up time). Each says which on its line or the line above."""
    import ast

    unexplained = []
    for path in sorted((ROOT / "src" / "parallama").rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    said = lines[node.lineno - 1] + lines[node.lineno - 2]
                    if not any(reason in said for reason in REASONS):
                        unexplained.append(
                            f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}"
                        )
    assert not unexplained, "\n".join(sorted(set(unexplained)))


def test_class_paths_that_moved_still_build_from_saved_configs():
    """Saved run configs and checkpoints name parts by dotted path: each moved path is an alias of the new one
    (docs/architecture.md, "Moved paths")."""
    moved = {
        "parallama.data.tokenizer.byte_level": parallama.tokenizer.byte_level,
        "parallama.data.tokenizer.train_bpe": parallama.tokenizer.train_bpe,
        "parallama.training.callbacks.PreemptionCheckpoint": parallama.training.preemption.PreemptionCheckpoint,
    }
    for old, new in moved.items():
        assert get_object(old) is new, old
