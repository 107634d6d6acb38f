"""A clean install: the wheel puts the repository's top-level ``passes/`` and ``csrc/`` inside the ``cp_ops``
namespace (``cp_ops.passes``, ``cp_ops/csrc/*.cu``) and nothing else at the top level of site-packages; a fresh
non-editable install compiles with the overlap pass and finds the fast transport's sources in the installed copy;
an editable install (what CI and the README use) maps ``cp_ops.passes`` to the checkout's ``passes/``.

The fresh environments are virtualenvs without pip whose only other path is this interpreter's site-packages
(torch and the build tools: a ``.pth`` line, which adds the folder but runs none of its ``.pth`` files, so an
editable install of this or another checkout there stays out of the way).
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("cp_ops", "passes", "csrc")  # what the wheel is built from (pyproject.toml's package-dir)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the checkout's package sources (no build outputs), to build and install from."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for part in PARTS:
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info"))
    return src


def _pip(python: str, *args: str) -> None:
    p = subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True, timeout=300)
    if p.returncode != 0 and "No module named" in p.stderr and "setuptools" in p.stderr:
        pytest.skip("setuptools is not installed")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _pip(sys.executable, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out), str(source))
    (whl,) = out.glob("*.whl")
    return whl


def _fresh_venv(path: Path) -> tuple[str, Path]:
    """A virtualenv at ``path`` that sees this interpreter's site-packages (torch, pip, setuptools) after its own;
    returns (its python, its site-packages)."""
    venv.create(path, with_pip=False, symlinks=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)}))
    (site / "outer.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return str(path / "bin" / "python"), site


def _run(python: str, code: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CP_OPS_", "PYTHONPATH", "TORCH_LOGS"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cwd / "inductor-cache")
    p = subprocess.run([python, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _wheel_holds_everything_inside_cp_ops(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    top = {n.split("/")[0] for n in names}
    assert top == {"cp_ops", "cp_ops-0.1.0.dist-info"}, top  # no top-level passes or csrc
    want = {f"cp_ops/{p.relative_to(ROOT / 'cp_ops').as_posix()}" for p in (ROOT / "cp_ops").rglob("*.py")}
    want |= {f"cp_ops/passes/{p.relative_to(ROOT / 'passes').as_posix()}" for p in (ROOT / "passes").rglob("*.py")}
    want |= {f"cp_ops/csrc/{p.name}" for p in (ROOT / "csrc").glob("*.cu")}
    assert {"cp_ops/passes/__init__.py", "cp_ops/csrc/cp_fast.cu", "cp_ops/csrc/lse_merge.cu"} <= want
    missing = sorted(want - names)  # e.g. a new package under cp_ops/ not listed in pyproject.toml
    assert not missing, f"the wheel lacks {missing}: list the package in pyproject.toml [tool.setuptools] packages"
    entry_points = zipfile.ZipFile(wheel).read("cp_ops-0.1.0.dist-info/entry_points.txt").decode()
    assert "[console_scripts]" in entry_points and "cp_ops." not in entry_points.replace("cp_ops.cli", ""), entry_points


_SMOKE = """
    import importlib.util, logging, os, sys
    import torch, torch.distributed as dist
    import cp_ops, cp_ops.passes
    from cp_ops import _ext
    site = os.path.realpath({site!r})
    inside = lambda p: os.path.realpath(p).startswith(site + os.sep)
    assert inside(cp_ops.__file__) and inside(cp_ops.passes.__file__), (cp_ops.__file__, cp_ops.passes.__file__)
    assert importlib.util.find_spec("passes") is None and importlib.util.find_spec("csrc") is None
    for src in _ext._sources():  # the fast build's sources: the installed copies
        assert src.is_file() and inside(src), src
        print("source", src)

    # compile with the overlap pass on CPU (a fake 2-rank group: shapes only) and see it open a window; Inductor
    # without C++ kernels, as in the rest of the suite (tests/inductor_mode.py): the pass and its window do not
    # depend on them, and this cold cache would compile each kernel
    import torch._inductor.config as inductor_config
    from torch.testing._internal.distributed.fake_pg import FakeStore
    inductor_config.fallback_by_default = True
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("cp_ops.passes").addHandler(handler)
    logging.getLogger("cp_ops.passes").setLevel(logging.DEBUG)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(64, 64) for _ in range(3))

        def forward(self, x):
            q = torch.nn.functional.rms_norm(self.q(x), (64,)).view(1, 16, 4, 16)
            k, v = self.k(x).view(1, 16, 4, 16), self.v(x).view(1, 16, 4, 16)
            return cp_ops.attention(q, k, v, mode="agkv", transport="torch", chunks=1)

    with torch.no_grad():
        out = cp_ops.compile(Block(), fullgraph=True)(torch.randn(1, 16, 64))
    assert out.shape == (1, 16, 4, 16), out.shape
    assert any("window 0:" in m for m in records), records
    print("compiled with the pass")
"""


def test_wheel_then_its_fresh_install_compiles_with_the_pass_and_finds_the_sources(wheel, tmp_path):
    """The wheel's contents (everything inside cp_ops), then a fresh install of it (`pip install .` is a build of this
    wheel and its install: one build serves both checks)."""
    _wheel_holds_everything_inside_cp_ops(wheel)
    python, site = _fresh_venv(tmp_path / "venv")
    _pip(python, "install", "--no-deps", "--no-index", "-q", str(wheel))
    assert (site / "cp_ops" / "passes" / "overlap.py").is_file()
    assert not (site / "passes").exists() and not (site / "csrc").exists(), sorted(os.listdir(site))
    out = _run(python, _SMOKE.format(site=str(site)), tmp_path)
    assert "compiled with the pass" in out
    found = [Path(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("source ")]
    assert [p.name for p in found] == ["cp_fast.cu", "lse_merge.cu"], found
    assert found[0].read_bytes() == (ROOT / "csrc" / "cp_fast.cu").read_bytes()


def test_editable_install_maps_passes_and_csrc_to_the_checkout(source, tmp_path):
    python, site = _fresh_venv(tmp_path / "venv")
    _pip(python, "install", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-e", str(source))
    out = _run(python, """
        import importlib.util
        import cp_ops.passes, cp_ops.passes.overlap
        from cp_ops import _ext
        assert importlib.util.find_spec("passes") is None and importlib.util.find_spec("csrc") is None
        print(cp_ops.__file__, cp_ops.passes.__file__, cp_ops.passes.overlap.__file__, _ext.source_path())
    """, tmp_path)
    paths = [Path(p) for p in out.split()]
    want = [source / "cp_ops" / "__init__.py", source / "passes" / "__init__.py", source / "passes" / "overlap.py",
            source / "csrc" / "cp_fast.cu"]
    assert [p.resolve() for p in paths] == [p.resolve() for p in want], paths
