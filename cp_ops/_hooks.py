"""The compile hooks: what runs once, the first time a cp_ops op is traced (the fake kernels of :mod:`cp_ops.ops` call
:func:`run_compile_hooks`). The package registers the Inductor lowerings of the launches here (``cp_ops/__init__.py``),
so the ops import nothing above them and ``import cp_ops`` imports neither :mod:`cp_ops.passes` nor Inductor (~1 s).
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("cp_ops")

_hooks: list[Callable[[], None]] = []
_hooks_ran = False


def add_compile_hook(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once, outside fake mode, at the first trace of a cp_ops op (at once if that trace happened)."""
    _hooks.append(fn)
    if _hooks_ran:
        _run(fn)


def _run(fn) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes():
        fn()


def run_compile_hooks() -> None:
    """Fake kernels call this: on the first trace, run the registered hooks once each, outside fake mode."""
    global _hooks_ran
    if _hooks_ran:
        return
    _hooks_ran = True
    for fn in _hooks:
        _run(fn)
