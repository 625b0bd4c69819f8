"""Every `ConfigError` a tool can raise reaches the user as one line and exit status 2: each message is written
on one line, each way into a tool (its preflight, its Hydra task, a sweeper Hydra runs) answers through
errors.exit_status, and exit_status keeps a message built from another error's on one line. The cases
themselves: tests/unit/test_bad_config.py (config), tests/integration/test_bad_config_cli.py (the command line,
the files a run reads, a sweeper's refusal), tests/integration/test_bad_data.py (data)."""

from __future__ import annotations

import ast
import inspect
from importlib import import_module
from pathlib import Path

import tomllib

import parallama
from parallama.errors import ConfigError, exit_status

SRC = Path(parallama.__file__).parent
ROOT = SRC.parents[1]


def config_errors() -> list[tuple[str, int, ast.expr | None]]:
    """(file, line, message) of every `raise ConfigError(...)` in src/parallama."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            exc = node.exc if isinstance(node, ast.Raise) else None
            if isinstance(exc, ast.Call) and getattr(exc.func, "id", None) == "ConfigError":
                found.append((str(path.relative_to(SRC)), node.lineno, exc.args[0] if exc.args else None))
    return found


def test_every_config_error_is_written_on_one_line():
    errors = config_errors()
    assert len(errors) > 150  # the walk sees them (206 when written)
    multi_line = [
        f"{file}:{line}"
        for file, line, message in errors
        if message is None
        or any(isinstance(c, ast.Constant) and "\n" in str(c.value) for c in ast.walk(message))
    ]
    assert multi_line == []


def test_a_message_built_from_another_errors_is_one_line():
    assert exit_status(ConfigError("cannot read x.json: Expecting value\n  line 1")) == (
        2,
        "error: cannot read x.json: Expecting value line 1",
    )
    assert exit_status(ConfigError("a  b")) == (2, "error: a  b")  # one line already: as written


def test_every_tool_runs_through_the_front_door():
    """Each console script's `main` is cli/app.py's `run`: its preflight and its task answer in one line."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert len(scripts) == 7
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        source = inspect.getsource(getattr(import_module(module), function))
        assert "app.run(" in source, name


def test_every_sweeper_answers_in_one_line():
    """A sweeper runs outside the tool's task (Hydra calls it, and prints what it raises as a traceback): each
    one parallama registers is wrapped (sweeps/jobs.py `one_line_errors`), and its launcher runs inside it."""
    from hydra.plugins.sweeper import Sweeper

    import hydra_plugins.parallama_sweeps as plugins

    sweepers = [c for c in vars(plugins).values() if isinstance(c, type) and issubclass(c, Sweeper)]
    assert {c.__name__ for c in sweepers} == {"GridSweeper", "OptunaPruningSweeper"}
    for sweeper in sweepers:
        assert sweeper.sweep.__wrapped__, sweeper
