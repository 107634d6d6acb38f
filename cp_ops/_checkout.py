"""Where cp_ops' two non-core parts live: ``passes/`` and ``csrc/`` beside ``cp_ops/`` in a checkout, installed by a
wheel as ``cp_ops/passes`` and ``cp_ops/csrc`` (``pyproject.toml``'s package-dir). In a checkout (a ``pyproject.toml``
beside ``cp_ops/``, the part missing inside it), :func:`install` puts first in ``sys.meta_path`` a finder that
resolves exactly ``cp_ops.passes`` to ``<root>/passes`` (another checkout's editable install does not win), and
:func:`part_dir` gives ``<root>/csrc``. Imports nothing of cp_ops; :mod:`cp_ops` runs :func:`install` first.
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
    """The repository root when cp_ops runs from a checkout (``pyproject.toml`` beside ``cp_ops/``), else None."""
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
