"""The GPU machine's scripts install the carried wheels once: benchmarks/gpu_one.sh's bound section runs
benchmarks/gpu_bound.sh, which does not install them again; each script alone still installs them. Run on CPU with
stand-ins for python3 and nvidia-smi that log their arguments (nothing is installed or run)."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tree(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the GPU scripts with a carried wheel in .whl/, and an environment whose python3 and nvidia-smi log
    their command lines to calls.log."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    for f in (ROOT / "benchmarks").glob("gpu_*.sh"):
        shutil.copy(f, root / "benchmarks" / f.name)
    (root / ".whl").mkdir()
    (root / ".whl" / "fake-0.1-py3-none-any.whl").write_bytes(b"")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name in ("python3", "nvidia-smi"):
        p = bin_dir / name
        p.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 0\n')
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_SITE_READY", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return root, env


def _installs(tmp_path: Path) -> list[str]:
    return [ln for ln in (tmp_path / "calls.log").read_text().splitlines() if "-m pip install" in ln]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_one_installs_the_wheels_once(tmp_path):
    root, env = _tree(tmp_path)
    r = subprocess.run(["bash", "benchmarks/gpu_one.sh", str(tmp_path / "out"), "bound"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls.log").read_text()
    assert "-m cp_ops bound" in calls, calls  # the bound section ran gpu_bound.sh's steps
    assert len(_installs(tmp_path)) == 1, calls
    # gpu_bound.sh alone installs them
    (tmp_path / "calls.log").unlink()
    r = subprocess.run(["bash", "benchmarks/gpu_bound.sh", str(tmp_path / "out2"), "wan@eager"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(_installs(tmp_path)) == 1, (tmp_path / "calls.log").read_text()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_steps_runs_the_named_steps_under_the_deadline(tmp_path):
    """benchmarks/gpu_steps.sh (sourced by a results folder's call.sh): each named step's command, FW and CW reaching
    the whole-model compile, an unknown step named in the log, and a step skipped once less than its minimum is left."""
    root, env = _tree(tmp_path)
    out = tmp_path / "out"
    env.update(OUT=str(out), STEPS="t2r flux_full nosuch", FW="4", CW="3")
    r = subprocess.run(["bash", "benchmarks/gpu_steps.sh"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls.log").read_text()
    assert "-m pytest -q -rs -p no:cacheprovider -m gpu tests/test_one_gpu.py tests/test_fp8.py -k two_ranks" in calls
    assert ("-m cp_ops bound flux --worlds 4 --compile-modes full --compile-workers 3 --no-group1 --warmup 1 --repeats 3 "
            f"--out {out}/json/flux_full.json") in calls
    log = (out / "log.txt").read_text()
    assert "=== t2r: rc=0" in log and "=== flux_full: rc=0" in log and "=== unknown step nosuch" in log, log
    assert len(_installs(tmp_path)) == 1, calls
    # END=100: t2r (minimum 60 s) runs, flux_full (minimum 150 s) is skipped and says why
    (tmp_path / "calls.log").unlink()
    env.update(OUT=str(tmp_path / "out2"), END="100")
    r = subprocess.run(["bash", "benchmarks/gpu_steps.sh"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (tmp_path / "out2" / "log.txt").read_text()
    assert "=== t2r: rc=0" in log and "=== flux_full: skipped" in log and "needs 150" in log, log
    assert "-m cp_ops run" not in (tmp_path / "calls.log").read_text()


def test_gpu_scripts_name_modules_and_files_that_exist():
    """Every cp_ops module a GPU script imports (``from cp_ops.x import y``, ``import cp_ops.x``, ``python3 -m
    cp_ops...``) and every tests/ or benchmarks/ file it names exists in this tree: a rename the scripts missed fails
    here, on CPU, instead of in a device call (gpu_one.sh's build step imported a module renamed months before)."""
    import importlib
    import importlib.util
    import re

    bad = []
    for f in sorted((ROOT / "benchmarks").glob("gpu_*.sh")):
        text = f.read_text()
        for m in re.finditer(r"from (cp_ops(?:\.\w+)*) import ([\w, ]+?)(?: as \w+)?[;\n\"']", text):
            mod, names = m.group(1), [n.strip() for n in m.group(2).split(",")]
            if importlib.util.find_spec(mod) is None:
                bad.append(f"{f.name}: module {mod}")
                continue
            pkg = importlib.import_module(mod)
            for n in names:
                if not hasattr(pkg, n) and importlib.util.find_spec(f"{mod}.{n}") is None:
                    bad.append(f"{f.name}: {mod}.{n}")
        for m in re.finditer(r"(?:import|-m) (cp_ops(?:\.\w+)+)", text):
            if importlib.util.find_spec(m.group(1)) is None:
                bad.append(f"{f.name}: module {m.group(1)}")
        for m in re.finditer(r"\b((?:tests|benchmarks)/[\w/]+\.(?:py|sh))", text):
            if not (ROOT / m.group(1)).exists():
                bad.append(f"{f.name}: file {m.group(1)}")
    assert not bad, bad


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_one_lanes_world_sizes_and_end(tmp_path):
    """gpu_one.sh: 'a+b/c' runs lane a-then-b beside lane c (each its own log), a section's world sizes reach pytest's
    -k, the records are merged once at the end; with END spent, a step is skipped and says so (non-zero exit)."""
    root, env = _tree(tmp_path)
    out = tmp_path / "out"
    r = subprocess.run(["bash", "benchmarks/gpu_one.sh", str(out), "shared:w8+faults/wan:w2,w4"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls.log").read_text()
    assert "tests/test_one_gpu.py -k shared_device and (w8)" in calls, calls
    assert "tests/test_one_gpu.py -k wan_full and (w2 or w4)" in calls, calls
    assert "tests/test_one_gpu_faults.py -k never_arrives or killed or test_one_gpu_faults" in calls, calls
    lanes = [(out / f"log_{n}.txt").read_text() for n in (1, 2)]
    assert "=== shared_w8: rc=0" in lanes[0] and "=== faults: rc=0" in lanes[0], lanes[0]
    assert "=== wan_w2,w4: rc=0" in lanes[1], lanes[1]
    assert len([c for c in calls.splitlines() if c.startswith("python3 - ")]) == 1, calls  # one merge, at the end
    env["END"] = "10"
    r = subprocess.run(["bash", "benchmarks/gpu_one.sh", str(tmp_path / "out2"), "flux"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "=== flux: skipped (END=10 s" in (tmp_path / "out2" / "log.txt").read_text()
