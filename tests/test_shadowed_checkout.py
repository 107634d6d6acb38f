"""A script run from the folder above a checkout named ``cp_ops`` (issue 22 item 7): Python takes the checkout's root
for ``cp_ops``. Before the checkout's root ``__init__.py`` it was an empty namespace package — in front of an
editable install's finder, too — and the script failed later with ``AttributeError: module 'cp_ops' has no attribute
'attention'``. Now an installed cp_ops is loaded in its place, and without one ImportError names the folder and the
fix. Each case is a fresh ``python -S`` (no site-packages: only what the case puts on the path) in a tmp folder."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "cp_ops"


def _run(tmp_path: Path, code: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` as ``script.py`` in a folder holding ``cp_ops`` (a link to this checkout's root)."""
    parent = tmp_path / "work"
    parent.mkdir(exist_ok=True)
    if not (parent / "cp_ops").exists():
        (parent / "cp_ops").symlink_to(ROOT, target_is_directory=True)
    (parent / "script.py").write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP") and not k.startswith("CP_OPS_")}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-S", "script.py"], cwd=parent, env=env, capture_output=True, text=True,
                          timeout=60)


def test_not_installed_gets_a_hint(tmp_path):
    p = _run(tmp_path, "import cp_ops\ncp_ops.attention\n")
    here = tmp_path / "work" / "cp_ops"
    assert p.returncode != 0
    assert (f"ImportError: cp_ops was imported from {here}, a folder without the cp_ops package (the root of a cp_ops "
            f"source checkout: the package is {here / 'cp_ops'})") in p.stderr, p.stderr
    assert f"run from elsewhere (e.g. inside the checkout), or `pip install {here}`" in p.stderr, p.stderr
    assert "AttributeError" not in p.stderr


def test_an_editable_install_behind_the_folder_is_loaded(tmp_path):
    # pip install -e's finder comes after the path finder in sys.meta_path (setuptools' _EditableFinder)
    p = _run(tmp_path, f"""
        import importlib.util, sys

        class Editable:
            @classmethod
            def find_spec(cls, name, path=None, target=None):
                if name == "cp_ops":
                    return importlib.util.spec_from_file_location(name, {str(PKG / '__init__.py')!r},
                                                                  submodule_search_locations=[{str(PKG)!r}])

        sys.meta_path.append(Editable)
        import cp_ops, cp_ops.config
        print(cp_ops.__file__, cp_ops.__version__, cp_ops.config.__file__)
    """)
    assert p.returncode == 0, p.stderr
    from cp_ops import __version__

    assert p.stdout.split() == [str(PKG / "__init__.py"), __version__, str(PKG / "config.py")], p.stdout


def test_an_install_later_on_the_path_is_loaded(tmp_path):
    p = _run(tmp_path, "import cp_ops\nprint(cp_ops.__file__)\n", pythonpath=str(ROOT))
    assert p.returncode == 0, p.stderr
    assert Path(p.stdout.strip()).resolve() == (PKG / "__init__.py").resolve(), p.stdout


def test_under_another_name_it_does_nothing(tmp_path):
    p = _run(tmp_path, "import runpy\nruntime = runpy.run_path('cp_ops/__init__.py', run_name='__init__')\n"
                       "print(sorted(k for k in runtime if not k.startswith('_')))\n")
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr)
