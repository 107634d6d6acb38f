"""The compile hook: the Inductor lowerings of the cp_ops launches (:func:`cp_ops.passes.lowering.register`),
registered the first time a cp_ops op is traced (``torch.compile``, ``make_fx``, opcheck) — the fake kernels of
:mod:`cp_ops.ops` call :func:`run_compile_hooks`.

So plain ``torch.compile`` (without :func:`cp_ops.compile`) lowers the launches as collectives, whose inputs stay
alive until their waits, while ``import cp_ops`` imports neither :mod:`cp_ops.passes` nor ``torch._inductor``
(about a second): the import is lazy, here, on the first trace.
"""

from __future__ import annotations

import logging

log = logging.getLogger("cp_ops")

_hooks_ran = False


def _call_outside_fake(fn) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes():
        fn()


def run_compile_hooks() -> None:
    """Fake kernels call this: on the first trace, register the launches' Inductor lowerings once, outside fake
    mode. A failure is a warning (tracing goes on; Inductor then lowers the launches as plain kernels)."""
    global _hooks_ran
    if _hooks_ran:
        return
    _hooks_ran = True
    _call_outside_fake(_register_lowerings)


def _register_lowerings() -> None:
    try:
        from .passes.lowering import register

        register()
    except Exception as e:  # noqa: BLE001 - a broken lowering must not break tracing
        log.warning(
            "cp_ops: the Inductor lowerings of the cp_ops launches (cp_ops.passes.lowering) were not registered: "
            "%s: %s; Inductor lowers the launches as plain kernels and may reuse a launch's input before its wait",
            type(e).__name__, e,
        )
