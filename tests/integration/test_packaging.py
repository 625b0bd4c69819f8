"""A regular (non-editable) install ships the Hydra configs and finds them: build the wheel, install it into
a folder, run from there."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_ships_the_configs_and_the_installed_package_finds_them(tmp_path):
    src = tmp_path / "src"  # build from a copy: the build leaves build/ and *.egg-info behind
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "local")
    for name in ("src", "conf"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    # a new package (a model family's folder) that no file names: found because pyproject finds the packages
    (src / "src" / "parallama" / "models" / "new_family").mkdir()
    (src / "src" / "parallama" / "models" / "new_family" / "__init__.py").write_text("")
    (src / "conf" / "local").mkdir()
    (src / "conf" / "local" / "default.yaml").write_text("seed: 1\n")  # a machine's own: not shipped
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path, src], check=True)
    (wheel,) = tmp_path.glob("parallama-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for conf in ("train.yaml", "eval.yaml", "data/source/files.yaml", "strategy/fsdp.yaml"):
        assert f"parallama/conf/{conf}" in names
    assert not [n for n in names if "/local/" in n]
    # every module of the source tree (the new folder too; namespace packages without an __init__.py, e.g.
    # parallama/evaluation and hydra_plugins, as well), and not the placeholder that lets discovery find conf
    modules = sorted(p.relative_to(src / "src").as_posix() for p in (src / "src").rglob("*.py"))
    assert [m for m in modules if m not in names] == []
    assert "parallama/conf/README" not in names

    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", target, wheel], check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    check = "import parallama; print(parallama.CONF_DIR)"
    out = subprocess.run([sys.executable, "-c", check], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert Path(out.stdout.strip()) == target / "parallama" / "conf", out.stderr
    # every subpackage imports from the installed wheel (not from this checkout)
    packages = sorted({".".join(Path(m).parent.parts) for m in modules})
    check = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    print(name, list(importlib.import_module(name).__path__)[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", check, *packages], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    imported = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert sorted(imported) == packages and {"parallama.evaluation", "parallama.models.new_family"} <= set(
        packages
    )
    assert [n for n, path in imported.items() if not Path(path).is_relative_to(target)] == []
    for module, needle in [
        ("parallama.cli.train", "strategy: auto, ddp, ddp_sharded, ddp_spawn, deepspeed, fsdp"),
        ("parallama.cli.evaluate", "ckpt_path: null"),
        ("parallama.cli.prepare", "num_proc: null"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", module, "--help"], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert proc.returncode == 0 and needle in proc.stdout, proc.stderr[-2000:]


def test_every_console_script_is_installed_and_names_a_main_that_exists():
    """Each console script of the installed distribution (pyproject.toml's `[project.scripts]`) is in this
    environment's bin and calls a function its module has (parallama-train and parallama-export also run as
    installed: test_strategies.py, test_export.py)."""
    import importlib
    from importlib.metadata import distribution

    scripts = [e for e in distribution("parallama").entry_points if e.group == "console_scripts"]
    assert sorted(e.name for e in scripts) == [
        f"parallama-{tool}" for tool in ("ckpt", "eval", "export", "generate", "plan", "prepare", "train")
    ]
    for script in scripts:
        module, _, function = script.value.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), script.value
        installed = (Path(sys.executable).parent / script.name).read_text()
        assert f"from {module} import {function}" in installed, (script.name, installed)
