"""Compile hooks: how a compiler integration (``passes/``: the Inductor lowerings and the overlap pass) plugs
into the core without the core importing it — the dependency runs one way, ``passes`` → ``cp_ops``.

Integrations are declared as Python entry points (``pyproject.toml``, ``[project.entry-points."<group>"]``):

* :data:`COMPILE_HOOK_GROUP` (``cp_ops.compile_hooks``): callables with no arguments, run once, outside fake
  mode, the first time a cp_ops op is traced (``torch.compile``, ``make_fx``, opcheck) — the fake kernels of
  :mod:`cp_ops.ops` call :func:`run_compile_hooks`. The project declares ``passes.lowering:register``
  there, so plain ``torch.compile`` gets the lowerings that keep a launch's inputs alive until its wait.
* ``cp_ops.overlap_pass`` (read by :func:`cp_ops.compile`): the overlap pass's Inductor options.

Found in installed distributions' metadata (``importlib.metadata``) and, when cp_ops runs from a source tree
(``PYTHONPATH`` at a checkout: no install, or an install of another checkout), in that tree's
``pyproject.toml`` (Python >= 3.11).
"""

from __future__ import annotations

import logging

log = logging.getLogger("cp_ops")

COMPILE_HOOK_GROUP = "cp_ops.compile_hooks"
_compile_hooks: list = []  # added by add_compile_hook()
_hooks_ran = False


def add_compile_hook(fn) -> None:
    """Run ``fn()`` the first time a cp_ops op is traced (at once when that already happened)."""
    _compile_hooks.append(fn)
    if _hooks_ran:
        _call_outside_fake(fn)


def declared_entry_points(group: str) -> list[tuple[str, object]]:
    """``(name, loaded object)`` of every entry point declared in ``group`` (see the module docs), sorted by
    name. One that fails to load is left out with a warning."""
    import importlib
    import importlib.metadata as md
    import os

    found = {(ep.name, ep.value) for ep in md.entry_points(group=group)}
    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        import tomllib

        with open(pyproject, "rb") as f:
            meta = tomllib.load(f).get("project", {})
        if meta.get("name") == "cp_ops":
            found |= set(meta.get("entry-points", {}).get(group, {}).items())
    except (ImportError, OSError, ValueError):  # Python 3.10 (no tomllib) or not a source tree
        pass
    out = []
    for name, value in sorted(found):
        try:
            mod, _, attr = value.partition(":")
            obj = importlib.import_module(mod.strip())
            for part in attr.strip().split(".") if attr.strip() else ():
                obj = getattr(obj, part)
            out.append((name, obj))
        except Exception as e:  # noqa: BLE001 - a broken integration must not break tracing
            log.warning("cp_ops: entry point %s = %r (group %r) not loaded: %s: %s", name, value, group, type(e).__name__, e)
    return out


def _call_outside_fake(fn) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes

    with unset_fake_temporarily(), _disable_current_modes():
        fn()


def run_compile_hooks() -> None:
    """Fake kernels call this: on the first trace, load and run every compile hook once, outside fake mode
    (one that fails: a warning; tracing goes on)."""
    global _hooks_ran
    if _hooks_ran:
        return
    _hooks_ran = True
    _call_outside_fake(_load_and_run_hooks)


def _load_and_run_hooks() -> None:
    hooks = list(_compile_hooks) + [fn for _, fn in declared_entry_points(COMPILE_HOOK_GROUP)]
    if not hooks:
        log.warning(
            "cp_ops: no compile hooks found (entry-point group %r): Inductor lowers the cp_ops launches as plain "
            "kernels and may reuse a launch's input before its wait; install cp_ops (pip install -e .)",
            COMPILE_HOOK_GROUP,
        )
    for fn in hooks:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a broken integration must not break tracing
            log.warning("cp_ops: compile hook %r failed: %s: %s", fn, type(e).__name__, e)
