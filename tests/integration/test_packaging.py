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
    (src / "conf" / "local").mkdir()
    (src / "conf" / "local" / "default.yaml").write_text("seed: 1\n")  # a machine's own: not shipped
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path, src], check=True)
    (wheel,) = tmp_path.glob("parallama-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for conf in ("train.yaml", "eval.yaml", "data/source/files.yaml", "strategy/fsdp.yaml"):
        assert f"parallama/conf/{conf}" in names
    assert not [n for n in names if "/local/" in n]
    # every package of the source tree (a model family's folder too: pyproject lists them one by one)
    packages = [p.parent.relative_to(ROOT / "src") for p in (ROOT / "src" / "parallama").rglob("__init__.py")]
    assert [str(p) for p in packages if f"{p.as_posix()}/__init__.py" not in names] == []

    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", target, wheel], check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    check = "import parallama; print(parallama.CONF_DIR)"
    out = subprocess.run([sys.executable, "-c", check], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert Path(out.stdout.strip()) == target / "parallama" / "conf", out.stderr
    for module, needle in [
        ("parallama.cli.train", "strategy: auto, ddp, ddp_sharded, ddp_spawn, deepspeed, fsdp"),
        ("parallama.cli.evaluate", "ckpt_path: null"),
        ("parallama.cli.prepare", "num_proc: null"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", module, "--help"], env=env, cwd=tmp_path, capture_output=True, text=True
        )
        assert proc.returncode == 0 and needle in proc.stdout, proc.stderr[-2000:]
