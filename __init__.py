"""The root of a cp_ops source checkout: not the cp_ops package, which is ``cp_ops/`` inside this folder.

Python runs this file only where it takes this folder itself for ``cp_ops``: a script run from the folder *above* a
checkout named ``cp_ops`` (the script's folder comes first on ``sys.path``). Without this file Python would import
the folder as an empty namespace package, in front of any installed cp_ops (``pip install -e .`` adds its finder
after the folders of ``sys.path``), and the script would fail later with ``AttributeError: module 'cp_ops' has no
attribute 'attention'``. Here, instead:

* cp_ops installed (``pip install .`` or ``pip install -e .``, of this checkout or another): that package is loaded
  in this one's place — what Python does when no folder named ``cp_ops`` is in the way;
* not installed: ImportError naming this folder and the two ways out (run from elsewhere, or ``pip install``).

Imported under any other name (pytest imports a rootdir's ``__init__.py`` as ``__init__``), it does nothing.
"""

import importlib.machinery as _machinery
import os as _os
import sys as _sys


def _installed_spec():
    """The spec of a cp_ops package found past this folder (every meta-path finder; the path finder without the
    ``sys.path`` entries whose ``cp_ops`` is this folder), or None."""
    here = _os.path.realpath(_os.path.dirname(_os.path.abspath(__file__)))
    me = _os.path.realpath(_os.path.abspath(__file__))
    path = [p for p in _sys.path if _os.path.realpath(_os.path.join(p or _os.getcwd(), "cp_ops")) != here]
    for finder in list(_sys.meta_path):
        try:
            if finder is _machinery.PathFinder:
                spec = _machinery.PathFinder.find_spec(__name__, path)
            elif hasattr(finder, "find_spec"):
                spec = finder.find_spec(__name__, None)
            else:
                continue
        except (ImportError, OSError, ValueError, TypeError, AttributeError):
            continue
        if spec is not None and spec.loader is not None and spec.origin \
                and _os.path.realpath(spec.origin) != me:
            return spec
    return None


def _take_the_installed_package() -> None:
    import importlib.util

    spec = _installed_spec()
    if spec is None:
        here = _os.path.dirname(_os.path.abspath(__file__))
        raise ImportError(
            f"cp_ops was imported from {here}, a folder without the cp_ops package (the root of a cp_ops source "
            f"checkout: the package is {_os.path.join(here, 'cp_ops')}), because the script runs from "
            f"{_os.path.dirname(here)} and no installed cp_ops was found: run from elsewhere (e.g. inside the "
            f"checkout), or `pip install {here}`"
        )
    module = importlib.util.module_from_spec(spec)
    _sys.modules[__name__] = module  # the import statement returns what sys.modules holds once this file ends
    try:
        spec.loader.exec_module(module)
    except BaseException:
        _sys.modules.pop(__name__, None)
        raise


if __name__ == "cp_ops":
    _take_the_installed_package()
