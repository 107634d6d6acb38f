"""Inductor passes of cp_ops: the K/V-communication overlap pass.

With the pass on, every ``torch.compile``'d model that calls :func:`cp_ops.attention` (or the launches
``torch.ops.cp_ops.*_start`` directly) runs its K/V communication under the Q projection, Q norm and Q RoPE:
no model edits. See :mod:`cp_ops.passes.overlap` for how.

Public API:
    install()        turn it on for every later compilation in this process (idempotent); uninstall() undoes
    enabled()        context manager: on for the compilations that happen inside it (first calls!)
    OverlapPass      the ``CustomGraphPass`` (stable ``uuid()``, so Inductor's FX graph cache stays on)
    PinWindows       the scheduler pass (``pin_windows``) that keeps each window's order in the generated code

Both also register the Inductor lowerings of the launches (:mod:`cp_ops.passes.lowering`), which make Inductor keep
each launch's inputs alive until its wait; plain ``torch.compile`` gets them too: the compile hook :mod:`cp_ops` registers
(:mod:`cp_ops._hooks`) imports :mod:`cp_ops.passes.lowering` on the first trace; ``import cp_ops`` does not import
this package. The pass keeps every launch off a pool slot whose output is still unread
(:func:`cp_ops.transport.base.inflight_limit` slots per key, taken in turn). Logs go to the ``cp_ops.passes`` logger (debug level: each
window, the nodes moved, fused projections left whole).

This folder sits at the repository's top level (``passes/``); the wheel installs it as ``cp_ops/passes`` and a
checkout maps it there at import (:mod:`cp_ops._checkout`): import it as ``cp_ops.passes``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from typing import Any, Iterator

from cp_ops.transport.base import inflight_limit

from .lowering import register as register_lowerings
from .overlap import TAG, overlap_kv_communication
from .pin import pin_windows

__all__ = ["install", "uninstall", "enabled", "OverlapPass", "PinWindows", "pin_windows", "inductor_options", "TAG"]

log = logging.getLogger("cp_ops.passes")
_DIR = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(None)
def _source_hash() -> str:
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(_DIR) if f.endswith(".py")):  # every module of the pass
        with open(os.path.join(_DIR, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def _custom_graph_pass_base() -> type:
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass

        return CustomGraphPass
    except ImportError:  # pragma: no cover - very old Inductor: a plain callable (FX graph cache bypassed)
        return object


class OverlapPass(_custom_graph_pass_base()):
    """Post-grad FX pass (``torch._inductor.config.post_grad_custom_post_pass``): opens the K/V windows.

    ``__call__(graph)`` rewrites the ``torch.fx.Graph`` in place (see :func:`cp_ops.passes.overlap.overlap_kv_communication`);
    ``uuid()`` is a hash of this package's source and the in-flight limit it enforces, so the FX graph cache
    stays on and is invalidated when either changes. An optional ``inner`` pass (one installed before ours) runs first.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner

    def __eq__(self, other: object) -> bool:  # equal passes keep Inductor backends equal: see _same_pass
        return _same_pass(self, other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, id(self.inner) if self.inner is not None else None))

    def __call__(self, graph) -> None:
        if self.inner is not None:
            self.inner(graph)
        log.debug("cp_ops.passes: the overlap pass runs on a graph of %d nodes (compiled now, not from a cache)",
                  len(graph.nodes))
        overlap_kv_communication(graph)

    def uuid(self) -> Any:
        inner = None
        if self.inner is not None:
            inner = self.inner.uuid() if hasattr(self.inner, "uuid") else None
            if inner is None:
                return None  # the inner pass cannot be cached, so neither can we
        _say_cached()
        return ("cp_ops.passes.OverlapPass", _source_hash(), inflight_limit(), inner)


_said_cached = False


def _say_cached() -> None:
    """Once per process, at debug level: Inductor keys its caches by the pass (its ``uuid``), and a graph its FX graph
    cache (or AOTAutograd's) holds comes back with the windows the pass made when it was first compiled, without
    running the pass — so a warm cache logs no windows."""
    global _said_cached
    if not _said_cached and log.isEnabledFor(logging.DEBUG):
        _said_cached = True
        log.debug("cp_ops.passes: Inductor keys its compile caches by the overlap pass; a graph found in the cache "
                  "comes back with the windows the pass opened when it was first compiled, and the pass does not run "
                  "again (no 'runs on a graph' line, no windows logged). TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 "
                  "compiles (and logs) every graph anew")


def _custom_scheduler_pass_bases() -> tuple[type, ...]:
    """Bases for :class:`PinWindows`: ``CustomSchedulerPass`` and also ``CustomGraphPass``. The FX graph cache
    of older Inductors (torch 2.11) keeps caching only when ``_pre_fusion_custom_pass`` is a ``CustomGraphPass``;
    newer ones (2.13) ask for a ``CustomSchedulerPass``. Both are ABCs wanting ``__call__`` and ``uuid``."""
    bases = []
    try:
        from torch._inductor.custom_graph_pass import CustomSchedulerPass

        bases.append(CustomSchedulerPass)
    except ImportError:  # pragma: no cover - older Inductor
        pass
    graph_pass = _custom_graph_pass_base()
    if graph_pass is not object:
        bases.append(graph_pass)
    return tuple(bases) or (object,)


class PinWindows(*_custom_scheduler_pass_bases()):
    """Scheduler pass (``torch._inductor.config._pre_fusion_custom_pass``): :func:`cp_ops.passes.pin.pin_windows`.

    A ``CustomSchedulerPass`` (and ``CustomGraphPass``, see :func:`_custom_scheduler_pass_bases`) with the same
    source-hash ``uuid()`` as :class:`OverlapPass`, so the FX graph cache stays on (a raw callable there makes
    Inductor bypass the cache). An optional ``inner`` scheduler
    pass (one installed before ours) runs first.
    """

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner

    def __eq__(self, other: object) -> bool:  # equal passes keep Inductor backends equal: see _same_pass
        return _same_pass(self, other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, id(self.inner) if self.inner is not None else None))

    def __call__(self, snodes):
        if self.inner is not None:
            snodes = self.inner(snodes)
        return pin_windows(snodes)

    def uuid(self) -> Any:
        inner = None
        if self.inner is not None:
            inner = self.inner.uuid() if hasattr(self.inner, "uuid") else None
            if inner is None:
                return None
        return ("cp_ops.passes.PinWindows", _source_hash(), inflight_limit(), inner)


def _same_pass(a: Any, b: Any) -> bool:
    """Two of our passes are equal when of one class around the same inner pass. Each ``cp_ops.compile`` call
    makes new pass objects; ``torch.compile``'s Inductor backend compares its options by ``==``, and Dynamo
    reuses a compiled frame only under an equal backend: with identity equality, compiling each instance of a
    repeated block (regional compilation) recompiled the shared ``forward`` once per instance."""
    return type(a) is type(b) and a.inner is b.inner


def _is_ours(p: Any) -> bool:
    return isinstance(p, (OverlapPass, PinWindows))


def inductor_options(existing: dict | None = None) -> dict:
    """Inductor config entries that turn the pass on, merged over ``existing`` (e.g. ``torch.compile(options=)``).

    Keys: ``post_grad_custom_post_pass`` (:class:`OverlapPass`) and, where this Inductor has it,
    ``_pre_fusion_custom_pass`` (:class:`PinWindows`). A pass already set there runs before ours.
    """
    import torch._inductor.config as cfg

    register_lowerings()
    opts = dict(existing or {})
    post = opts.get("post_grad_custom_post_pass", cfg.post_grad_custom_post_pass)
    if not _is_ours(post):
        if isinstance(post, (list, tuple)):
            post = post[0] if len(post) == 1 else _PassSequence(post)
        post = OverlapPass(post)
    opts["post_grad_custom_post_pass"] = post
    if hasattr(cfg, "_pre_fusion_custom_pass"):
        pre = opts.get("_pre_fusion_custom_pass", cfg._pre_fusion_custom_pass)
        if not _is_ours(pre):
            pre = PinWindows(pre)
        opts["_pre_fusion_custom_pass"] = pre
    else:  # pragma: no cover - depends on the torch version
        log.warning(
            "cp_ops.passes: this Inductor has no _pre_fusion_custom_pass; the windows are ordered in the FX graph "
            "but Inductor's scheduler may reorder Q kernels out of them"
        )
    return opts


class _PassSequence:
    """Several post-grad passes run in order, as one (a list set in the config before ours)."""

    def __init__(self, passes) -> None:
        self.passes = list(passes)

    def __call__(self, graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        ids = [p.uuid() if hasattr(p, "uuid") else None for p in self.passes]
        return None if any(i is None for i in ids) else tuple(ids)


_saved: dict | None = None


def install() -> None:
    """Turn the overlap pass on for every compilation from now on in this process (idempotent).

    Sets ``torch._inductor.config.post_grad_custom_post_pass`` and ``_pre_fusion_custom_pass`` (keeping any pass
    already there, which then runs first) and registers the launches' Inductor lowerings. Already compiled
    graphs are not recompiled. :func:`uninstall` restores the previous values.
    """
    global _saved
    import torch._inductor.config as cfg

    if _is_ours(cfg.post_grad_custom_post_pass):
        return
    keys = ["post_grad_custom_post_pass"] + (["_pre_fusion_custom_pass"] if hasattr(cfg, "_pre_fusion_custom_pass") else [])
    _saved = {k: getattr(cfg, k) for k in keys}
    for k, v in inductor_options().items():
        setattr(cfg, k, v)


def uninstall() -> None:
    """Undo :func:`install`: restore the Inductor config values it replaced (no-op when not installed)."""
    global _saved
    import torch._inductor.config as cfg

    if _saved is None:
        return
    for k, v in _saved.items():
        setattr(cfg, k, v)
    _saved = None


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Context manager: the overlap pass is on for compilations that *happen* inside it.

    ``torch.compile`` compiles at a model's first call, so make that call inside the block::

        with cp_ops.passes.enabled():
            out = compiled(x)   # compiles here, with the pass
    """
    import torch._inductor.config as cfg

    with cfg.patch(inductor_options()):
        yield
