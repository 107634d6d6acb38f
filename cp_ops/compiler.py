"""``cp_ops.compile``: ``torch.compile`` with the K/V-communication overlap pass on (each K/V launch moved right after
K and V are ready, its wait right before attention: the transfer runs under Q's projection, norm and RoPE), and
without Dynamo's guards on cp_ops' own code. The pass is imported lazily, when :func:`compile` is called.

Guards: a block calling ``cp_ops.attention`` (Ulysses, torch 2.13) has 291 guards, 155 of them on the identity of
cp_ops' functions, classes and modules, evaluated at every call; :func:`compile` leaves those out (cp_ops' code is
taken to stay as imported). Every guard on values stays (settings, constants, shapes, tensors, the user's code).
Measured: docs/own_cost.md.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Sequence

#: the guard kinds on an object's identity (a function's code and closure, a module, a class, two sources being one
#: object) that :func:`skip_cp_ops_code_guards` leaves out where the object is reached from a cp_ops module's globals
_CODE_GUARDS = frozenset(("CLOSURE_MATCH", "MODULE_MATCH", "CLASS_MATCH", "DUPLICATE_INPUT", "ID_MATCH"))
#: what those guards may be about: code (a module — torch.ops namespaces are modules too —, a function, a class)
_CODE_KINDS = (types.ModuleType, types.FunctionType, types.CodeType, type)
#: how Dynamo names a global source reached through a module of cp_ops (``G['__import_cp_ops_dot_dispatch'].modes``)
_CP_OPS_GLOBAL = "G['__import_cp_ops"


def skip_cp_ops_code_guards(entries: Sequence) -> list[bool]:
    """A ``guard_filter_fn``: False (leave out) for a guard on the identity of a function, class or module reached
    from a cp_ops module's globals, True for every other guard. Patching a cp_ops function after a compile therefore
    needs ``torch._dynamo.reset()``."""
    return [not (e.is_global and e.guard_type in _CODE_GUARDS and e.name.startswith(_CP_OPS_GLOBAL)
                 and e.has_value and isinstance(e.value, _CODE_KINDS)) for e in entries]


def _guard_filter(options: dict | None) -> dict:
    """``options`` with :func:`skip_cp_ops_code_guards` as ``guard_filter_fn``, and any filter already there (AND)."""
    opts = dict(options or {})
    theirs = opts.get("guard_filter_fn")
    if theirs is None:
        opts["guard_filter_fn"] = skip_cp_ops_code_guards
    elif theirs is not skip_cp_ops_code_guards:
        opts["guard_filter_fn"] = lambda entries: [a and b for a, b in zip(theirs(entries),
                                                                        skip_cp_ops_code_guards(entries))]
    return opts


def compile(model: Callable | None = None, *, overlap: bool = True, **kwargs: Any):  # noqa: A001 - mirrors torch.compile
    """``torch.compile(model, **kwargs)`` with the cp_ops overlap pass enabled for this model only, without Dynamo's
    guards on cp_ops' own code (module docstring).

    Args:
        model: an ``nn.Module`` or function (``None``: returns a decorator, as ``torch.compile`` does).
        overlap: False compiles without the pass (same lowerings), for A/B comparisons.
        **kwargs: passed to ``torch.compile``. The pass rides in ``options`` (passes you set there run first);
            ``mode`` is turned into the Inductor options it stands for (``mode`` and ``options`` exclude each
            other); ``options['guard_filter_fn']`` is :func:`skip_cp_ops_code_guards` (yours, if given, runs too).
    Returns:
        What ``torch.compile`` returns.
    Raises:
        ValueError: ``backend`` other than 'inductor' (the pass is an Inductor pass).
        ImportError: ``overlap=True`` and :mod:`cp_ops.passes` does not import (cp_ops installed without it).
    """
    import torch

    backend = kwargs.get("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"cp_ops.compile runs Inductor passes and needs backend='inductor'; got backend={backend!r}")
    options, mode = kwargs.get("options"), kwargs.pop("mode", None)
    if mode is not None:  # (mode and options exclude each other in torch.compile)
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode, kwargs.get("dynamic")), **(options or {})}
    if overlap:
        from .passes import inductor_options

        options = inductor_options(options)
    options = _guard_filter(options)
    kwargs.pop("options", None)

    def run(m):  # a fresh options dict each time: torch.compile pops guard_filter_fn out of the one it is given
        return torch.compile(m, options=dict(options), **kwargs)

    return run if model is None else run(model)
