"""The lean eager path of :func:`cp_ops.attention`: per-call decisions cached by a key, ops called directly.

Eager (not while ``torch.compile`` traces), a call of :func:`cp_ops.attention` looks up its *plan* by

    (q/k/v shapes, dtypes and devices, group, mode, transport, chunks[, seq_lens, key_mask shape/dtype/device])

A plan holds what the first call with that key decided after running every input check
(:func:`cp_ops.attention._checked`): the process group, the concrete mode, the resolved transport name, the
stage count, the mode's direct implementation, the transport object (:func:`cp_ops.transport.base.for_group`,
re-bound after :func:`~cp_ops.transport.base.forget_groups`) and the rank contract's signature
(:class:`cp_ops.contract.CallCheck`). A repeat call is a dict lookup, **one** signature exchange across the
ranks (the rank contract of :mod:`cp_ops.contract`: still every call, unless ``CP_OPS_CHECK_RANKS=off``), and
the mode's work: transport launches and waits and the attention kernels, called directly instead of through
the ``torch.library`` dispatcher (whose Python wrapper, autograd and redispatch layers cost more than the rest).

Compiled code keeps the ops (their fake kernels, the overlap pass): under ``torch.compile`` this module is not
used. The exchange is named after the call's first op ('cp_ops::agkv_gather_start', 'cp_ops::ulysses_start',
'cp_ops::agkv_pipelined_attention'), and for chunks=1 AGKV and pipelined AGKV the signature equals that op's;
Ulysses adds its chunks (1 when not pipelined), so it never equals a bare all-to-all of the same tensors. Eager Ulysses makes one exchange per call where the op path makes one per
launch, so the ranks of a group must all run a Ulysses layer eager, or all compiled.

A call with ``seq_lens`` or ``key_mask`` (uneven shards, key-padding masks) has a plan of its own,
:class:`cp_ops.modes.uneven.EagerPlan` (its key adds ``seq_lens`` and the mask's shape; the mask's values are read
at every call): padded shapes, offsets and the index tensors that select the real rows, computed once; one
exchange per call, with the ``seq_lens`` tag of the uneven ops.

Tracing that is not Dynamo (``make_fx``, ``FakeTensorMode``, any torch dispatch mode) and tensor subclasses take
the general path too, so they see the ops. A mode takes this path when its function has an ``eager`` attribute:
``fn.eager(q, k, v, pg, transport_object, scale[, chunks])`` (the built-in modes do); others, and inputs
with no elements, take the general path (the ops). A new argument of :func:`cp_ops.attention` must be part
of the key or send the call to the general path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import config, modes
from .modes import pipelined, tune
from .transport import base as transport_base
from .contract import CallCheck

_dispatch_modes = torch._C._len_torch_dispatch_stack  # > 0 while a TorchDispatchMode (tracing, fake, ...) is active
_MAX_PLANS = 1024  # distinct keys kept (a model has a handful; a shape sweep clears and refills)
_plans: dict = {}


class Plan:
    """What a call with one key runs: see the module docstring. ``run(q, k, v, scale)`` → output."""

    __slots__ = ("pg", "world", "group", "resolved", "fn", "chunks", "check", "tr", "epoch", "device")

    def __init__(self, pg, group, resolved, fn, chunks, check, device):
        self.pg, self.world, self.group, self.resolved = pg, pg.size(), group, resolved
        self.fn, self.chunks, self.check, self.device = fn, chunks, check, device
        self.tr, self.epoch = None, -1

    def run(self, q, k, v, scale, key_mask=None):  # key_mask: always None here (a layout call has its own plan)
        if self.check is not None:
            self.check.check()  # the rank contract: before any data moves
        if self.world == 1:
            return self.fn(q, k, v, scale)
        if self.epoch != transport_base.epoch:  # first call, or the transports' per-group choices were reset
            self.tr = transport_base.for_group(self.resolved, self.pg, self.device)
            self.epoch = transport_base.epoch
        if self.chunks:
            return self.fn(q, k, v, self.pg, self.tr, scale, self.chunks)
        return self.fn(q, k, v, self.pg, self.tr, scale)


def lookup(q, k, v, group, mode, transport, chunks, seq_lens=None, key_mask=None):
    """The plan for this call (built and cached on the first call with its key), or None: take the general path
    (an argument that is not a plain tensor — a tensor subclass, a FakeTensor —, a torch dispatch mode active —
    make_fx tracing, FakeTensorMode, a flop or comm counter: they must see the ops —, a mode without a direct
    implementation, an empty tensor; with ``seq_lens``/``key_mask``: ``seq_lens`` not a tuple or list of ints,
    a key mask that is not a plain tensor, no element to move on any rank)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor \
            or _dispatch_modes():
        return None
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, group, mode,
               transport, chunks, type(chunks), config.settings.tune_modes)
        if seq_lens is not None or key_mask is not None:
            extra = _layout_key(seq_lens, key_mask)
            if extra is None:
                return None
            key += extra
        p = _plans.get(key)
    except (AttributeError, TypeError):  # not tensors, an unhashable group: the general path raises the error
        return None
    if p is not None:
        if group is None and p.pg is not dist.group.WORLD:  # the default group was destroyed or replaced
            _plans.pop(key, None)
            return None
        return p.plan
    plan = _build(q, k, v, group, mode, transport, chunks, seq_lens, key_mask)
    if len(_plans) >= _MAX_PLANS:
        _plans.clear()
    _plans[key] = _Entry(plan, plan.pg if plan is not None else _default_or_none(group))  # None: the general path
    return plan


class _Entry:
    """A cached decision: the plan, or None (the general path: a mode without a direct implementation, an
    empty tensor), and the group it was made for."""

    __slots__ = ("plan", "pg")

    def __init__(self, plan, pg):
        self.plan, self.pg = plan, pg


def _default_or_none(group):
    return dist.group.WORLD if group is None else None


def _layout_key(seq_lens, key_mask):
    """What a ``seq_lens`` / ``key_mask`` call adds to its key: ``seq_lens`` (a tuple of ints) and the mask's shape,
    dtype and device (its values are data, read at every call); None: the general path (it raises on a bad one).
    Ints only, by type: ``4.0`` and ``True`` hash like ``4`` and ``1`` but are not token counts."""
    if seq_lens is not None:
        if type(seq_lens) is not tuple:
            if type(seq_lens) is not list:
                return None
            seq_lens = tuple(seq_lens)
        for n in seq_lens:
            if type(n) is not int:
                return None
    if key_mask is None:
        return (seq_lens, None)
    if type(key_mask) is not torch.Tensor:
        return None
    return (seq_lens, key_mask.shape, key_mask.dtype, key_mask.device)


def _build(q, k, v, group, mode, transport, chunks, seq_lens=None, key_mask=None):
    from .attention import _checked, local_attention
    from .group import resolve_group

    pg = resolve_group(group)
    if seq_lens is not None or key_mask is not None:  # uneven shards / key mask: cp_ops.modes.uneven
        from .modes import uneven

        chosen, resolved = _checked(q, k, v, pg, mode, transport, chunks, (seq_lens, key_mask))  # raises as the API
        return uneven.eager_plan(q, pg, chosen, resolved, seq_lens, key_mask is not None)
    chosen, resolved = _checked(q, k, v, pg, mode, transport, chunks)  # raises (on every rank) as the API does
    if q.numel() == 0:
        return None
    w = pg.size()
    if w == 1:
        return Plan(pg, group, resolved, lambda q, k, v, scale: local_attention(q, k, v, scale), 0, None, q.device)
    chosen, c = tune.decide(mode, chunks, chosen, q, pg, resolved)  # 'auto'/None: measured once, then cached
    if c > 1 and chosen in pipelined.PIPELINED:
        fn = getattr(pipelined.PIPELINED[chosen], "eager", None)
        stages = c
    else:
        fn = getattr(modes.get(chosen).fn, "eager", None)
        stages = 0
    if fn is None:
        return None
    sig = getattr(fn, "signature", None)
    if sig is None:
        return None
    op, t, extra, sig_chunks = sig(q, k, v, stages)
    check = CallCheck(pg, op, resolved, t.shape, t.dtype, extra, sig_chunks)
    return Plan(pg, group, resolved, fn, stages, check, q.device)


def forget() -> None:
    """Drop every cached plan (tests; after changing what a plan caches, e.g. the chunks choice)."""
    _plans.clear()
