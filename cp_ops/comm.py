"""The communication interface every mode body is written against, and its two implementations.

A mode body (:mod:`cp_ops.modes`) is one function ``body(q, k, v, comm, *, scale, chunks, shards)`` (a 2-D mode's
``comm`` is a :class:`MeshComm`: one comm per mesh dim). It never
touches a process group, an op or a transport: it launches through ``comm`` and waits on what the launch
returned, so the same body runs

* **traced** (``torch.compile``, make_fx, FakeTensor, a dispatch mode, a direct op call) with :class:`OpComm`:
  every launch is a ``torch.ops.cp_ops.*_start`` op (:mod:`cp_ops.ops`) and every wait is
  ``torch.ops._c10d_functional.wait_tensor``, which a compiler can move (the overlap pass, :mod:`cp_ops.passes`);
* **eager** with :class:`DirectComm`: every launch calls the transport object (:mod:`cp_ops.transport`) directly
  and every wait is ``work.wait()`` — no dispatcher on the hot path.

Launches (each returns a :class:`Pending`; ``pending.wait()`` gives the received tensors, valid on the current
stream):

* ``agkv(k, v, mask=None)`` — ``[B, S, H, D]`` × 2 → ``(k_full, v_full [B, W*S, H, D], mask_full)``, tokens in
  rank order; ``mask`` (uint8 ``[B, S]``) travels with them → ``[W*B, S]`` (rank-major), else ``mask_full`` None.
* ``mask(m)`` — uint8 ``[B, S]`` → ``[W*B, S]`` (rank-major): a key mask beside a Ulysses call.
* ``ulysses(xs, lo=0, hi=None)`` — n × ``[B, S, H, D]`` → ``buf [W, B, S, n, hi-lo, D]`` (heads ``[lo, hi)`` of every
  head group; all of them by default).
* ``ulysses_inverse(x)`` — ``[B, S, Hl, D]`` → ``buf [W, B, S/W, Hl, D]``.
* ``agkv_sources(k, v, pieces)`` — :class:`DirectComm` only (pipelined AGKV, which traced code runs inside one op,
  ``cp_ops::agkv_pipelined_attention``): ``(k_full, v_full, arrivals, work)`` as
  :func:`cp_ops.transport.base.agkv_start_sources`.

**The rank contract** (:mod:`cp_ops.contract`): one exchange per call, made by the call's *first* launch in both
implementations, with the same signature (call name, the first launch's tensor shape and dtype and tensor count,
the transport argument, and ``tag``: a hash of the variant — mode, chunks, uneven shards, mask, the caller's
layer tag — described in words in error messages). Later launches of the same call exchange nothing: the body
is deterministic, so once the first launch agrees the rest of the schedule does too.

**Faults** (issue 20 item 9): a comm remembers what it launched and nobody waited yet; :meth:`drain` waits for
all of it. The dispatcher calls it when a body raises between a launch and its wait (e.g. CUDA OOM in the
attention), so the transport's buffers and the group's collectives are left consistent and the next call works;
the peers' matching collectives complete, so no peer is left waiting in this call.
"""

from __future__ import annotations

import torch

from . import layout
from .transport.base import agkv_start_sources


class Pending:
    """A launch not yet waited: ``wait()`` returns its outputs (a tensor, or a tuple of them), valid on the current
    stream; waiting again returns them again."""

    __slots__ = ("outs", "work", "comm")

    def __init__(self, outs, work, comm):
        self.outs, self.work, self.comm = outs, work, comm

    def wait(self):
        comm = self.comm
        if comm is not None:
            self.comm = None
            comm.pending.discard(self)
            self.outs = comm._wait(self)
        return self.outs


class _DirectPending(Pending):
    """A :class:`DirectComm` launch: its wait is the transport's ``work.wait()`` (no further indirection: the eager
    hot path)."""

    __slots__ = ()

    def wait(self):
        comm = self.comm
        if comm is not None:
            self.comm = None
            comm.pending.discard(self)
            if self.work is not None:
                self.work.wait()
        return self.outs


class _Comm:
    """What both implementations share: the call's identity for the rank contract and the pending launches."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank
        self.pending: set[Pending] = set()

    _pending_type = Pending

    def _launched(self, outs, work) -> Pending:
        p = self._pending_type(outs, work, self)
        self.pending.add(p)
        return p

    def drain(self) -> None:
        """Settle every launch of this comm that nobody waited (after a body raised): ``work.cancel()`` where the
        transport's work has it (the fast transport: the copies already queued still land, the slots are given
        back), else a wait. Errors here are dropped (the body's own error is the one raised)."""
        while self.pending:
            p = self.pending.pop()
            p.comm = None
            try:
                cancel = getattr(p.work, "cancel", None)
                if cancel is not None:
                    cancel()
                else:
                    self._wait(p)
            except Exception:  # noqa: BLE001 - the caller re-raises the body's error
                pass

    def unpack(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The n slots of a received Ulysses buffer ``[W, B, S, n, Hl, D]`` as n tensors ``[B, W*S, Hl, D]``."""
        return layout.ulysses_unpack_all(buf)


class OpComm(_Comm):
    """Launches as ``torch.ops.cp_ops`` ops, waits as ``wait_tensor``: what traced code (and a compiler) sees.

    Args:
        world: the CP world size W. group_name: the CP group's name. transport: the resolved transport argument
            ('torch', 'fast' or 'auto': :func:`cp_ops.transport.base.resolve`). call: the rank contract's call name
            for the first launch (e.g. 'cp_ops.attention'). tag: the variant's hash (:func:`cp_ops.contract.variant_tag`).
        rank: this rank. seq_lens: the uneven token counts (given to the first launch, which folds them into the tag).
    """

    def __init__(self, world: int, group_name: str, transport: str, call: str, tag: int, rank: int,
                 seq_lens=None):
        super().__init__(world, rank)
        self.group_name, self.transport = group_name, transport
        self.call, self.tag, self.seq_lens = call, tag, None if seq_lens is None else list(seq_lens)

    def _args(self):
        """(call, tag, seq_lens) for the next launch: the call's on the first, '-' (no exchange) after."""
        call, self.call = self.call, "-"
        return call, self.tag, self.seq_lens

    def _wait(self, p: Pending):
        wait = torch.ops._c10d_functional.wait_tensor
        outs = p.outs
        if isinstance(outs, tuple):
            return tuple(None if t is None else wait(t) for t in outs)
        return wait(outs)

    def agkv(self, k, v, mask=None) -> Pending:
        kf, vf = torch.ops.cp_ops.agkv_gather_start(k, v, self.world, self.group_name, self.transport, *self._args())
        mf = None if mask is None else torch.ops.cp_ops.mask_gather_start(mask, self.world, self.group_name)
        return self._launched((kf, vf, mf), None)

    def mask(self, m) -> Pending:
        return self._launched(torch.ops.cp_ops.mask_gather_start(m, self.world, self.group_name), None)

    def ulysses(self, xs, lo: int = 0, hi: int | None = None) -> Pending:
        xs = [layout.ulysses_heads(x, self.world, lo, hi) for x in xs]
        buf = torch.ops.cp_ops.ulysses_start(xs, self.world, self.group_name, self.transport, *self._args())
        return self._launched(buf, None)

    def ulysses_inverse(self, x) -> Pending:
        buf = torch.ops.cp_ops.ulysses_inverse_start(x, self.world, self.group_name, self.transport, *self._args())
        return self._launched(buf, None)

    def unpack(self, buf):
        # per slot: the form the overlap pass looks for (select(buf, 3, i))
        return tuple(layout.ulysses_unpack(buf, i) for i in range(buf.shape[3]))

    def agkv_attention(self, q, k, v, scale, chunks: int):
        """Pipelined AGKV attention as one op (``cp_ops::agkv_pipelined_attention``, synchronous): what a 2-D body
        runs on its outer comm where the direct comm would run :mod:`cp_ops.modes.agkv_pipelined` (``seq_lens``: the
        outer dim's token counts). ``[B, S, H, D]`` → ``[B, S, H, D]``."""
        call, tag, seq = self._args()
        return torch.ops.cp_ops.agkv_pipelined_attention(q, k, v, self.world, self.group_name, self.transport, scale,
                                                         chunks, seq, call, tag)


class DirectComm(_Comm):
    """Launches as the transport object's methods, waits as ``work.wait()``: the eager path, no dispatcher.

    Args:
        pg: the CP process group. transport: the transport object (:func:`cp_ops.transport.base.for_group`).
        check: makes the rank contract's check of the calls' first launch: ``check(shape, dtype, extra)`` (the first
            launch's tensor — as the op would get it — and its tensor count) → an object whose ``check()`` exchanges
            (:class:`cp_ops.contract.CallCheck`; made once: a comm serves calls of one shape), or None (the caller
            exchanged already: the real kernel of ``cp_ops::agkv_pipelined_attention``).
        resolve: gives the transport object when ``transport`` is None, called once, after the first exchange
            (choosing it may be collective: :func:`cp_ops.transport.base.for_group`).
    Set ``armed = True`` before each call's first launch (the dispatcher's plan does).
    """

    _pending_type = _DirectPending
    unpack = staticmethod(layout.ulysses_unpack_all)

    def __init__(self, pg, transport, check=None, resolve=None):
        super().__init__(pg.size(), pg.rank())
        self.pg, self.tr, self.make_check, self.resolve = pg, transport, check, resolve
        self.armed, self.cc = False, None

    def _first(self, t, extra: int, shape=None) -> None:
        if self.armed:
            self.armed = False
            cc = self.cc
            if cc is None:
                cc = self.cc = self.make_check(t.shape if shape is None else shape, t.dtype, extra)
            cc.check()
        if self.tr is None:
            self.tr = self.resolve()

    def _wait(self, p: Pending):
        if p.work is not None:
            p.work.wait()
        return p.outs

    def agkv(self, k, v, mask=None) -> Pending:
        if self.armed or self.tr is None:
            self._first(k, 2)
        if mask is not None and getattr(self.tr, "gathers_masks", False):
            kf, vf, mf, work = self.tr.agkv_start(k, v, self.pg, mask=mask)  # one coalesced launch
            return self._launched((kf, vf, mf), work)
        kf, vf, work = self.tr.agkv_start(k, v, self.pg)
        if mask is None:
            return self._launched((kf, vf, None), work)
        mf, mwork = self._mask(mask)
        return self._launched((kf, vf, mf), _Both(work, mwork))

    def _mask(self, m):
        out = m.new_empty(self.world * m.shape[0], m.shape[1])
        return out, self.pg._allgather_base(out, m.contiguous())

    def mask(self, m) -> Pending:
        return self._launched(*self._mask(m))

    def agkv_sources(self, k, v, pieces: int):
        if self.armed or self.tr is None:
            self._first(k, 2)
        kf, vf, arrivals, work = agkv_start_sources(self.tr, k, v, self.pg, pieces)
        p = self._launched((kf, vf), work)  # drained on error; waited by the body as work.wait()
        return kf, vf, arrivals, _Done(p, work)

    def ulysses(self, xs, lo: int = 0, hi: int | None = None) -> Pending:
        if self.armed or self.tr is None:  # the op sees heads [lo, hi) of every head group: [B, S, W*(hi-lo), D]
            b, s, h, d = xs[0].shape
            self._first(xs[0], len(xs), (b, s, self.world * ((h // self.world if hi is None else hi) - lo), d))
        heads = getattr(self.tr, "ulysses_start_heads", None)  # packs a sub-group straight from the inputs
        if heads is not None:
            buf, work = heads(xs, self.pg, lo, hi)
        else:
            buf, work = self.tr.ulysses_start([layout.ulysses_heads(x, self.world, lo, hi) for x in xs], self.pg)
        return self._launched(buf, work)

    def ulysses_inverse(self, x) -> Pending:
        if self.armed or self.tr is None:
            self._first(x, 1)
        buf, work = self.tr.ulysses_inverse_start(x, self.pg)
        return self._launched(buf, work)


class MeshComm:
    """The comm of a 2-D mode body (:mod:`cp_ops.modes.agkv_ulysses`): two comms of the same kind, ``inner`` (the
    mesh's inner dim, Ulysses) and ``outer`` (its outer dim, AGKV); each makes its own group's rank-contract exchange
    at its first launch of a call (every rank is in one inner and one outer group, so when both agree every rank of
    the mesh agrees). Why a pair and not a sub-group argument on every launch: the bodies keep calling the 1-D
    launches unchanged, and a comm stays bound to one group (its transport, its contract state).

    Attributes: ``inner``, ``outer`` (:class:`OpComm` or :class:`DirectComm`), ``world`` (O·I)."""

    __slots__ = ("inner", "outer", "world")

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner
        self.world = outer.world * inner.world

    def drain(self) -> None:
        """:meth:`_Comm.drain` of both comms (after a body raised)."""
        self.inner.drain()
        self.outer.drain()


class _Both:
    """Two works as one."""

    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - Work signature
        self.a.wait()
        self.b.wait()
        return True


class _Done:
    """A transport's work that, once waited, also takes its launch off the comm's pending set."""

    __slots__ = ("p", "work")

    def __init__(self, p: Pending, work):
        self.p, self.work = p, work

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - Work signature
        self.p.wait()
        return True

    def __getattr__(self, name):  # wait_source and the like: the transport's own work
        return getattr(self.work, name)
