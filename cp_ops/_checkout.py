"""Where cp_ops' two non-core parts live: inside the package once installed, at the repository's top level in a
checkout.

The repository keeps ``passes/`` (the Inductor pass and lowerings) and ``csrc/`` (the CUDA sources) beside
``cp_ops/``; a wheel installs them as ``cp_ops/passes`` (the package :mod:`cp_ops.passes`) and ``cp_ops/csrc``
(package data: ``*.cu``), mapped by ``[tool.setuptools.package-dir]`` in ``pyproject.toml``. Nothing is installed
at the top level of site-packages.

In a checkout (``PYTHONPATH`` at the repository, or ``pip install -e .``), :func:`install` adds an import finder
that resolves exactly ``cp_ops.passes`` to ``<root>/passes`` (first in ``sys.meta_path``, so that an editable
install of *another* checkout does not win), and :func:`part_dir` gives ``<root>/csrc``. A checkout is told
apart by ``<root>/pyproject.toml`` beside ``cp_ops/`` and the part missing inside ``cp_ops/``: a wheel in
site-packages is never mistaken for one, even beside another project's top-level ``passes`` or ``csrc``.
Imports nothing of cp_ops (no cycle); :mod:`cp_ops` runs :func:`install` first thing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_PKG = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_PKG)
PARTS = ("passes", "csrc")  # top-level folders of the repository that the wheel puts inside cp_ops


def checkout_root() -> str | None:
    """The repository root when cp_ops runs from a checkout (``<root>/pyproject.toml`` beside ``cp_ops/``),
    else None (an installed wheel)."""
    return _ROOT if os.path.isfile(os.path.join(_ROOT, "pyproject.toml")) else None


def part_dir(name: str) -> str:
    """The folder of ``name`` (one of :data:`PARTS`): ``cp_ops/<name>`` when it exists there (a wheel), else
    ``<root>/<name>`` in a checkout; ``cp_ops/<name>`` (missing: the caller reports it) otherwise."""
    if name not in PARTS:
        raise ValueError(f"cp_ops._checkout.part_dir: {name!r} is not one of {PARTS}")
    inside = os.path.join(_PKG, name)
    root = checkout_root()
    if os.path.isdir(inside) or root is None:
        return inside
    return os.path.join(root, name)


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``cp_ops.passes`` at ``<root>/passes``; its submodules are then found by the ordinary path finder
    through the package's ``__path__``."""

    def __init__(self, location: str) -> None:
        self.location = location

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "cp_ops.passes":
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(self.location, "__init__.py"), submodule_search_locations=[self.location]
        )


def install() -> None:
    """In a checkout, make ``import cp_ops.passes`` load ``<root>/passes`` (idempotent; no-op in a wheel)."""
    location = part_dir("passes")
    if location == os.path.join(_PKG, "passes") or not os.path.isfile(os.path.join(location, "__init__.py")):
        return
    if any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _CheckoutFinder(location))
