"""The README's claims, checked (issue 12 items 6, 10-13): the two commands and CI, the usage example (CPU/gloo,
sharding, torchrun), the TORCH_LOGS switch, the extras, the layout and the CLI table."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def _section(title):
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CP_OPS_", "TORCH_LOGS"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_two_commands_and_ci_runs_the_test_command_in_a_fresh_virtualenv():
    blocks = re.findall(r"```bash\n(.*?)```", _section("The two commands"), re.S)
    assert len(blocks) == 2 and all(len(b.strip().splitlines()) == 1 for b in blocks), blocks
    bench, test = (b.strip() for b in blocks)
    assert bench.endswith("cp-ops bench") and test.endswith("python -m pytest -q -n auto")
    ci = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run")) if line.strip() and not line.startswith("#")]
    venv = next(i for i, line in enumerate(ci) if "-m venv" in line)
    activate = next(i for i, line in enumerate(ci) if "/bin/activate" in line)
    assert venv < activate < len(ci) - 1 and ci[-1] == test  # exactly the README's command, inside the venv


def test_usage_example_runs_under_torchrun(tmp_path):
    code = re.search(r"```python\n(# cp_example\.py.*?)```", _section("Use"), re.S).group(1)
    assert "torchrun --nproc-per-node 2 cp_example.py" in code and "r * S // W:(r + 1) * S // W" in code
    (tmp_path / "cp_example.py").write_text(code)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "cp_example.py"],
                       capture_output=True, text=True, timeout=180, env=_env(), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rank 0: ok (1, 512, 8, 64)" in p.stdout and "rank 1: ok (1, 512, 8, 64)" in p.stdout


def test_torch_logs_switch_as_documented():
    text = _section("Overlap pass (torch.compile)")
    assert "TORCH_LOGS=+cp_ops python" in text
    # +cp_ops (the package) as the process starts, then +cp_ops.passes (a module since the pass lives in the cp_ops
    # namespace), then a sibling module only, each read again from the environment by torch's log set-up (one start)
    probe = """import logging, os, torch, cp_ops.passes
from torch._logging._internal import _init_logs
for setting, tag in (("+cp_ops", "A"), ("+cp_ops.passes", "B"), ("+cp_ops.cli", "C")):
    os.environ["TORCH_LOGS"] = setting
    _init_logs()
    logging.getLogger("cp_ops.passes").debug("probe 7f3a " + tag)
"""
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                       env=_env(TORCH_LOGS="+cp_ops"), cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "probe 7f3a A" in p.stderr and "probe 7f3a B" in p.stderr, p.stderr[-2000:]
    assert "probe 7f3a C" not in p.stderr, p.stderr[-2000:]  # the set-up was read again: the probe can fail


def test_extras_per_cuda_major():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    # numpy is a base dependency only so that torch does not warn "Failed to initialize NumPy" in every rank
    assert "numpy" in project["dependencies"]
    extras = project["optional-dependencies"]
    for major in ("12", "13"):
        assert f"nvshmem4py-cu{major}" in extras[f"fast-cu{major}"] and "numpy" in extras[f"fast-cu{major}"]
        assert f"`.[fast-cu{major}]`" in README
    assert extras["fast"] == extras["fast-cu13"] and "`.[fast]` is `.[fast-cu13]`" in " ".join(README.split())
    assert project["scripts"]["cp-ops"] == "cp_ops.cli.main:main"


def test_layout_matches_the_tree():
    block = re.search(r"```\n(.*?)```", _section("Layout"), re.S).group(1)
    for line in block.strip().splitlines():
        path, _, what = line.partition(" ")
        assert os.path.exists(os.path.join(ROOT, path)), f"README layout names {path}, which does not exist"
        folder = os.path.join(ROOT, path) if path.endswith("/") else os.path.dirname(os.path.join(ROOT, path))
        for name in re.findall(r"\b([a-z_]+\.py)\b", what):
            assert os.path.exists(os.path.join(folder, name)), f"README layout: {path} names {name}, not in {folder}"


def test_cli_table_matches_the_parser():
    from cp_ops.cli.main import build_parser

    text = _section("CLI")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    flags = {f for p in sub.values() for a in p._actions for f in a.option_strings}
    for cmd in re.findall(r"`cp-ops (\w+)", text):
        assert cmd in sub, cmd
    for flag in re.findall(r"(--[a-z][a-z-]+)", text):
        assert flag in flags or flag == "--nproc-per-node", f"README's CLI section names {flag}; the CLI has no such flag"


def test_readme_is_a_guide_a_user_finishes():
    """Issue 22 item 4: at most 150 lines, no commit hashes or run history, and links to docs that exist."""
    lines = README.splitlines()
    assert len(lines) <= 150, len(lines)
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", README) if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert not hashes, hashes
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        if not link.startswith("http"):
            assert os.path.exists(os.path.join(ROOT, link)), link

