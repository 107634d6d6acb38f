"""A non-editable install ships what the fast transport builds from (csrc/cp_fast.cu) and the pass (passes/),
and the build finds the source from the installed copy."""

import glob
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("cp_ops", "passes", "csrc"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    if p.returncode != 0 and "No module named" in p.stderr and "setuptools" in p.stderr:
        pytest.skip("setuptools is not installed")
    assert p.returncode == 0, p.stderr
    (whl,) = glob.glob(str(out / "*.whl"))
    return whl


def test_wheel_contains_cuda_source_and_passes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "csrc/cp_fast.cu" in names and "csrc/lse_merge.cu" in names
    for f in (ROOT / "passes").glob("*.py"):
        assert f"passes/{f.name}" in names, f.name


def test_installed_copy_finds_the_source(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), wheel],
                   check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CP_OPS_")}
    env["PYTHONPATH"] = str(target)
    code = ("from cp_ops.transport import _fast_build as b; p = b.source_path(); "
            "print(p); assert p.is_file(), p; print(len(p.read_bytes()))")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    found = Path(p.stdout.split()[0])
    assert found.resolve().is_relative_to(target.resolve()), found  # the installed copy, not this checkout
    assert found.read_bytes() == (ROOT / "csrc" / "cp_fast.cu").read_bytes()
