"""How a cp_ops ``torch.library`` op is registered: :func:`define`, a lean form of ``torch.library.custom_op``, whose
per-call Python layers cost a launch op ~13 µs of host time (17 µs against 4 µs; docs/own_cost.md).

:func:`define` registers with the low-level API (schema from ``torch.library.infer_schema``): the real kernel at
``CompositeExplicitAutograd``; an ``Autograd`` kernel that calls the real kernel at once (or redispatches where a key
below autograd — FakeTensor, functionalization, a dispatch mode — must see the call) unless grad mode is on and an
input requires grad, then runs the op's formula through torch's generated ``autograd.Function`` as ``custom_op``
does; the fake kernel. Kept from ``custom_op``: both kernels run outside Dynamo (their code marked skipped once,
:func:`_outside_dynamo`: a frame Dynamo runs eagerly must not trace the op's body), the ``pt2_compliant_tag``,
redefinition on reload. Given up: the per-call aliasing check (every op returns fresh tensors; ``opcheck`` checks it
in the tests). Mutating ops stay on ``custom_op`` (it also registers their ``ADInplaceOrView`` kernel).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import _C

#: op name -> the ``torch.library.Library`` holding its definition and kernels (kept across a reload of this module)
_LIBS: dict[str, torch.library.Library] = globals().get("_LIBS", {})


def _outside_dynamo(fn: Callable) -> Callable:
    """Mark ``fn``'s code, and every frame it calls, as never traced by Dynamo, without a per-call wrapper (where
    this torch lacks the frame-strategy API: ``torch._disable_dynamo``)."""
    ef = getattr(_C._dynamo, "eval_frame", None)
    try:
        ef.set_code_exec_strategy(fn.__code__, ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.SKIP))
    except AttributeError:  # pragma: no cover - depends on the torch version (2.11 and 2.13 have it)
        return torch._disable_dynamo(fn, recursive=True)
    return fn


#: dispatch keys whose kernel for a cp_ops op is the real kernel itself (``CompositeExplicitAutograd``): an autograd
#: kernel that finds one of them next calls the kernel directly
_BACKEND_KEYS = frozenset((_C.DispatchKey.CPU, _C.DispatchKey.CUDA))


class OpDef:
    """One op made by :func:`define`: ``_opoverload`` (``torch.ops.cp_ops.NAME.default``), ``_qualname``
    (``'cp_ops::NAME'``), ``_init_fn`` (the real kernel, a plain function); calling it calls the op."""

    def __init__(self, qualname: str, fn: Callable, lib: torch.library.Library):
        self._qualname, self._init_fn, self._lib = qualname, fn, lib
        self._name = qualname.split("::")[1]
        self._opoverload = getattr(torch.ops.cp_ops, self._name).default
        self._grad: Callable | None = None  # the autograd kernel for calls that need grad (made on first use)
        self._formula: tuple = (None, None)  # (backward, setup_context): register_autograd
        lib.impl(self._name, _outside_dynamo(fn), "CompositeExplicitAutograd")
        lib.impl(self._name, self._autograd, "Autograd", with_keyset=True)

    def __call__(self, *args, **kwargs):
        return self._opoverload(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(self._qualname, fn, lib=self._lib)
        return fn

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """``backward(ctx, *grads)`` and ``setup_context(ctx, inputs, output)`` as ``torch.library.register_autograd``
        takes them; run only for a call with grad mode on and an input that requires grad."""
        self._formula, self._grad = (backward, setup_context), None

    def _autograd(self, keyset, *args, **kwargs):
        if _C.is_grad_enabled() and _C._any_requires_grad(*args):
            if self._grad is None:
                from torch._library.autograd import Info, make_autograd_impl  # the kernel custom_op makes (2.4+)

                self._grad = make_autograd_impl(self._opoverload, Info(*self._formula))
            return self._grad(keyset, *args, **kwargs)
        below = keyset & _C._after_autograd_keyset
        if below.highestPriorityTypeId() in _BACKEND_KEYS:  # nothing between here and the kernel: call it (the
            return self._init_fn(*args, **kwargs)           # redispatch's round trip through C++ costs ~4 µs)
        return self._opoverload.redispatch(below, *args, **kwargs)  # a fake/functional/dispatch-mode key below


_outside_dynamo(OpDef._autograd)


def define(qualname: str) -> Callable[[Callable], OpDef]:
    """Decorator: define the op ``qualname`` (``'cp_ops::NAME'``, not mutating its inputs, tagged
    ``pt2_compliant_tag``) with the decorated function as its real kernel, its schema inferred from the annotations
    (``torch.library.infer_schema``). Defining a name again replaces the op (a reload of the defining module)."""
    ns, name = qualname.split("::")
    if ns != "cp_ops":
        raise ValueError(f"cp_ops defines ops in its own namespace only; got {qualname!r}")

    def wrap(fn: Callable) -> OpDef:
        old = _LIBS.pop(name, None)
        if old is not None:
            old._destroy()
        lib = _LIBS[name] = torch.library.Library("cp_ops", "FRAGMENT")
        lib.define(name + torch.library.infer_schema(fn, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
        return OpDef(qualname, fn, lib)

    return wrap
