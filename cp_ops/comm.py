"""The communication interface every mode body is written against, and its two implementations: traced code runs
:class:`OpComm` (launches are ``torch.ops.cp_ops.*_start`` ops, waits ``wait_tensor``, which a compiler can move),
eager code :class:`DirectComm` (the transport object called directly, waits ``work.wait()``: no dispatcher).

Launches (each returns a :class:`Pending`; ``wait()`` gives the received tensors, valid on the current stream):

* ``agkv(k, v, mask=None)`` — ``[B, S, H, D]`` × 2 → ``(k_full, v_full [B, W*S, H, D], mask_full)``, tokens in
  rank order; ``mask`` (uint8 ``[B, S]``) travels with them → ``[W*B, S]`` (rank-major), else ``mask_full`` None.
* ``mask(m)`` — uint8 ``[B, S]`` → ``[W*B, S]`` (rank-major): a key mask beside a Ulysses call.
* ``ulysses(xs, lo=0, hi=None, after=None)`` — n × ``[B, S, H, D]`` → ``buf [W, B, S, n, hi-lo, D]`` (heads
  ``[lo, hi)`` of every head group).
* ``ulysses_inverse(x, after=None)`` — ``[B, S, Hl, D]`` → ``buf [W, B, S/W, Hl, D]``; ``pending.wait_into(out)``
  writes it into ``out [B, S/W, W, Hl, D]``. ``after``: a tensor the launch must follow (traced only).
* ``agkv_sources(k, v, pieces)`` — :class:`DirectComm` only: as :func:`cp_ops.transport.base.agkv_start_sources`.

A call's first launch makes the rank contract's exchange. FP8 (``docs/fp8.md``): the comm's codec encodes what a
launch moves and its wait decodes it. :meth:`_Comm.drain` settles what a raising body left unwaited.
"""

from __future__ import annotations

import torch

from . import contract, layout
from .comm_dtype import NONE
from .kernels import fp8, fp8_ulysses
from .transport.base import Arrival, Works, agkv_start_sources, mask_all_gather, ulysses_packed_start


class Pending:
    """A launch not yet waited: ``wait()`` returns its outputs (again on a second wait)."""

    __slots__ = ("outs", "work", "comm", "post", "into")

    def __init__(self, outs, work, comm, post=None, into=None):
        self.outs, self.work, self.comm, self.post, self.into = outs, work, comm, post, into

    def wait_into(self, out: torch.Tensor) -> torch.Tensor:
        """An inverse launch's result written into ``out`` ``[B, S, W, Hl, D]`` (S ≤ the received tokens per block) and
        returned: decoded straight into it (``into``: eager FP8), else copied. Once per launch."""
        into = self.into
        if into is not None and self.comm is not None:
            self.into = self.post = None
            into(self.wait(), out)
            return out
        back = self.wait()
        if back.shape[2] != out.shape[1]:
            back = back.narrow(2, 0, out.shape[1])
        return out.copy_(back.permute(1, 2, 0, 3, 4))

    def wait(self):
        comm = self.comm
        if comm is not None:
            self.comm = None
            comm.pending.discard(self)
            self.outs = comm._wait(self)
            if self.post is not None:  # FP8: decode what arrived
                self.outs, self.post = self.post(self.outs), None
        return self.outs


class _OpPending(Pending):
    """An :class:`OpComm` launch: ``wait_into`` copies with an opaque op (a pooled slot is read there, not later)."""

    __slots__ = ()

    def wait_into(self, out: torch.Tensor) -> torch.Tensor:
        torch.ops.cp_ops.ulysses_inverse_copy_out(self.wait(), out)
        return out


class _DirectPending(Pending):
    """A :class:`DirectComm` launch: its wait is the transport's ``work.wait()`` (the eager hot path)."""

    __slots__ = ()

    def wait(self):
        comm = self.comm
        if comm is not None:
            self.comm = None
            comm.pending.discard(self)
            if self.work is not None:
                self.work.wait()
            if self.post is not None:  # FP8: decode what arrived
                self.outs, self.post = self.post(self.outs), None
        return self.outs


class DirectCodec:
    """FP8 on the link for the direct comm: the formats of (q, k, v, o) (``fmts``, '' = input dtype), their kernels."""

    __slots__ = ("fmts",)

    def __init__(self, fmts: tuple = NONE):
        self.fmts = fmts

    enc = staticmethod(fp8.encode)
    dec = staticmethod(fp8.decode)
    pack = staticmethod(fp8_ulysses.pack_encode)
    unpack = staticmethod(fp8_ulysses.unpack_decode)
    inv_unpack = staticmethod(fp8_ulysses.inverse_decode)


def _op(name):
    return lambda *args: getattr(torch.ops.cp_ops, name)(*args)


class OpCodec(DirectCodec):
    """:class:`DirectCodec` as ``torch.library`` ops: what traced code (and a compiler) sees."""

    __slots__ = ()
    enc = staticmethod(_op("fp8_encode"))
    dec = staticmethod(_op("fp8_decode"))
    pack = staticmethod(_op("fp8_ulysses_pack"))
    unpack = staticmethod(_op("fp8_ulysses_unpack"))
    inv_unpack = staticmethod(_op("fp8_ulysses_inverse_unpack"))


class _Comm:
    """What both implementations share: world, rank, the FP8 codec and the pending launches."""

    _codec_type = DirectCodec

    def __init__(self, world: int, rank: int, codec=None):
        self.world, self.rank = world, rank
        self.codec = self._codec_type() if codec is None else codec
        #: the formats of (q, k, v, o) on the link ('' = the input dtype): the codec's
        self.fmts = self.codec.fmts
        self.pending: set[Pending] = set()

    _pending_type = Pending

    def _launched(self, outs, work, post=None, into=None) -> Pending:
        p = self._pending_type(outs, work, self, post, into)
        self.pending.add(p)
        return p

    # ---- FP8: encode before the launch, decode in the wait (the codec gives enc/dec) ----
    def _agkv_codec(self, k, v):
        """``(k, v, post)``: the tensors an AGKV launch moves and what its wait applies to ``(k_full, v_full, m)``."""
        f = self.fmts[1]
        if not f:
            return k, v, None
        dt, enc, dec = k.dtype, self.codec.enc, self.codec.dec
        return enc(k, f), enc(v, f), lambda o: (dec(o[0], dt, f), dec(o[1], dt, f), o[2])

    def _groups(self, xs) -> list[tuple[str, list[int]]]:
        """The Ulysses inputs (q, k, v by position) by format ('' = input dtype), first seen first: one launch each."""
        groups: dict[str, list[int]] = {}
        for i in range(len(xs)):
            groups.setdefault(self.fmts[i] if i < 3 else "", []).append(i)
        return list(groups.items())

    def ulysses_launches_per_key(self) -> int:
        """The most launches one :meth:`ulysses` call of q, k, v makes with one pool key (op, shape, dtype): 2 where
        two FP8 formats hold one tensor each, else 1."""
        sizes = [len(idx) for f, idx in self._groups((None, None, None)) if f]
        return 2 if len(sizes) == 2 and sizes[0] == sizes[1] else 1  # (at most two FP8 groups: two formats)

    def _ulysses_sends(self, xs, lo, hi, pack):
        """The send buffers of a Ulysses launch, one per format group: ``[(fmt, idx, send [W, B, S, m, hs, D'])]``."""
        w = self.world
        return [(f, idx, self.codec.pack([xs[i] for i in idx], w, lo, hi, f) if f else pack([xs[i] for i in idx], w, lo, hi))
                for f, idx in self._groups(xs)]

    def _ulysses_decoded(self, groups, bufs, dt):
        """The wait's decode of a Ulysses launch (``groups``: (fmt, idx); ``bufs``: their receive buffers):
        ``[W, B, S, n, Hl, D]`` of ``dt``, a permuted view of one new ``[n, B, W*S, Hl, D]`` tensor (unpack: views)."""
        f0, _ = groups[0]
        if len(groups) == 1 and not f0:  # q, k, v in the input dtype (only O in FP8): the buffer as received
            return bufs[0]
        w, b, s, _, hl, d = bufs[0].shape
        d = d - fp8.SCALE_BYTES if f0 else d
        n = sum(len(idx) for _, idx in groups)
        if len(groups) == 1:
            out = self.codec.unpack(bufs[0], dt, f0)
        else:
            out = self._assemble(groups, bufs, dt, (n, b, w * s, hl, d))
        return out.view(n, b, w, s, hl, d).permute(2, 1, 3, 0, 4, 5)

    def _assemble(self, groups, bufs, dt, shape):
        """``[n, B, W*S, Hl, D]`` from groups of different formats (traced: a stack of the decoded slots)."""
        n, b, ws, hl, d = shape
        slots = [None] * n
        for (f, idx), buf in zip(groups, bufs):
            u = self.codec.unpack(buf, dt, f) if f else buf.permute(3, 1, 0, 2, 4, 5).reshape(len(idx), b, ws, hl, d)
            for j, i in enumerate(idx):
                slots[i] = u[j]
        return torch.stack(slots)

    def _inverse_decoded(self, buf, dt, f):
        """The wait's decode of an FP8 inverse launch: ``[W, B, S, Hl, D]``, a permuted view of a new tensor."""
        return self.codec.inv_unpack(buf, dt, f).permute(2, 0, 1, 3, 4)

    def drain(self) -> None:
        """Settle every launch nobody waited (after a body raised): ``work.cancel()`` where the work has it, else a wait
        (errors dropped: the body's is raised). Then tell the peers that this rank's call failed."""
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
        contract.call_failed(getattr(self, "pg", None) or getattr(self, "group_name", ""))


class OpComm(_Comm):
    """Launches as ``torch.ops.cp_ops`` ops, waits as ``wait_tensor``. ``call``, ``tag``, ``seq_lens``: the rank
    contract's words for the call's first launch; ``transport``: the resolved argument; ``codec``: None: no FP8."""

    _pending_type = _OpPending
    _codec_type = OpCodec

    def __init__(self, world: int, group_name: str, transport: str, call: str, tag: int, rank: int,
                 seq_lens=None, codec: OpCodec | None = None):
        super().__init__(world, rank, codec)
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
        k, v, post = self._agkv_codec(k, v)
        kf, vf = torch.ops.cp_ops.agkv_gather_start(k, v, self.world, self.group_name, self.transport, *self._args())
        mf = None if mask is None else torch.ops.cp_ops.mask_gather_start(mask, self.world, self.group_name)
        return self._launched((kf, vf, mf), None, post)

    def mask(self, m) -> Pending:
        return self._launched(torch.ops.cp_ops.mask_gather_start(m, self.world, self.group_name), None)

    def ulysses(self, xs, lo: int = 0, hi: int | None = None, after=None) -> Pending:
        if not any(self.fmts[:3]):  # q, k, v in the input dtype (O may travel in FP8: its own launch)
            return self._ulysses_packed(xs, lo, hi, after)
        dt, w = xs[0].dtype, self.world
        sends = self._ulysses_sends(xs, lo, hi, layout.ulysses_pack_traced)
        bufs = tuple(torch.ops.cp_ops.ulysses_packed_start(send, w, self.group_name, self.transport, *self._args(),
                                                           len(idx), after) for _, idx, send in sends)
        groups = [(f, idx) for f, idx, _ in sends]
        return self._launched(bufs, None, lambda b: self._ulysses_decoded(groups, b, dt))

    def _ulysses_packed(self, xs, lo, hi, after=None) -> Pending:
        """:meth:`ulysses` in the input dtype: the send buffer packed by traced code (Inductor writes it from the
        kernels producing the inputs), one launch with the eager path's signature (a rank may run a call eager while
        its peers run it compiled); the overlap pass splits it into K/V and Q launches."""
        w = self.world
        buf = torch.ops.cp_ops.ulysses_packed_start(layout.ulysses_pack_traced(xs, w, lo, hi), w, self.group_name,
                                                    self.transport, *self._args(), len(xs), after)
        return self._launched(buf, None)

    def ulysses_inverse(self, x, after=None) -> Pending:
        f, dt, post = self.fmts[3], x.dtype, None
        if f:
            x, post = self.codec.enc(x, f), (lambda b: self._inverse_decoded(b, dt, f))
        buf = torch.ops.cp_ops.ulysses_inverse_start(x, self.world, self.group_name, self.transport, *self._args(),
                                                     after)
        return self._launched(buf, None, post)

    def unpack(self, buf):
        # per slot: the form the overlap pass looks for (select(buf, 3, i))
        return tuple(layout.ulysses_unpack(buf, i) for i in range(buf.shape[3]))

    def agkv_attention(self, q, k, v, scale, chunks: int):
        """Pipelined AGKV attention as one synchronous op (a 2-D body's outer comm), ``[B, S, H, D]`` → the same."""
        call, tag, seq = self._args()
        return torch.ops.cp_ops.agkv_pipelined_attention(q, k, v, self.world, self.group_name, self.transport, scale,
                                                         chunks, seq, call, tag, self.fmts[1])


class DirectComm(_Comm):
    """Launches as the transport object's methods, waits as ``work.wait()``: the eager path. ``transport``: the
    object, or None: ``resolve()`` gives it after the first exchange (the choice may be collective). ``check(shape,
    dtype, extra)``: makes the :class:`cp_ops.contract.CallCheck` of a call's first launch (once), or None. Set
    ``armed = True`` before each call's first launch (the plan does)."""

    _pending_type = _DirectPending
    #: ``unpack(buf)``: the n slots of a received Ulysses buffer ``[W, B, S, n, Hl, D]`` as n ``[B, W*S, Hl, D]``
    unpack = staticmethod(layout.ulysses_unpack_all)

    def __init__(self, pg, transport, check=None, resolve=None, codec: DirectCodec | None = None):
        super().__init__(pg.size(), pg.rank(), codec)
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

    def _assemble(self, groups, bufs, dt, shape):
        """``[n, B, W*S, Hl, D]`` from groups of different formats: each decoded (or copied) into its slots."""
        n, b, ws, hl, d = shape
        out = torch.empty(shape, dtype=dt, device=bufs[0].device)
        for (f, idx), buf in zip(groups, bufs):
            step = idx[1] - idx[0] if len(idx) > 1 else 1
            if idx != list(range(idx[0], idx[-1] + 1, step)):  # (never: the FP8 groups hold slots of q, k, v)
                return super()._assemble(groups, bufs, dt, shape)
            dst = out[idx[0]:idx[-1] + 1:step]
            if f:
                fp8_ulysses.unpack_decode(buf, dt, f, out=dst)
            else:
                w = buf.shape[0]
                dst.view(len(idx), b, w, ws // w, hl, d).copy_(buf.permute(3, 1, 0, 2, 4, 5))
        return out

    def agkv(self, k, v, mask=None) -> Pending:
        post = None
        if self.fmts[1]:  # FP8 K/V
            k, v, post = self._agkv_codec(k, v)
        if self.armed or self.tr is None:
            self._first(k, 2)
        if mask is not None and getattr(self.tr, "gathers_masks", False):
            kf, vf, mf, work = self.tr.agkv_start(k, v, self.pg, mask=mask)  # one coalesced launch
            return self._launched((kf, vf, mf), work, post)
        kf, vf, work = self.tr.agkv_start(k, v, self.pg)
        if mask is None:
            return self._launched((kf, vf, None), work, post)
        mf, mwork = mask_all_gather(mask, self.pg)
        return self._launched((kf, vf, mf), Works((work, mwork)), post)

    def mask(self, m) -> Pending:
        return self._launched(*mask_all_gather(m, self.pg))

    def agkv_sources(self, k, v, pieces: int):
        if self.armed or self.tr is None:
            self._first(k, 2)
        f = self.fmts[1]
        if f:  # FP8: the pieces travel encoded; each is decoded into k_full/v_full when its arrival is waited
            b, s, h, d = k.shape
            kf, vf = k.new_empty(b, self.world * s, h, d), v.new_empty(b, self.world * s, h, d)
            ke, ve, arrivals, work = agkv_start_sources(self.tr, fp8.encode(k, f), fp8.encode(v, f), self.pg, pieces)
            decs = [_Decoding(a.work, ((ke, kf), (ve, vf)), a.lo, a.hi, f) for a in arrivals]
            arrivals = [Arrival(a.src, a.lo, a.hi, dw) for a, dw in zip(arrivals, decs)]
            work = _Decoding(work, (), 0, 0, f, decs)
        else:
            kf, vf, arrivals, work = agkv_start_sources(self.tr, k, v, self.pg, pieces)
        p = self._launched((kf, vf), work)  # drained on error; waited by the body as work.wait()
        return kf, vf, arrivals, _Done(p, work)

    def ulysses(self, xs, lo: int = 0, hi: int | None = None, after=None) -> Pending:
        # after: the traced path's ordering input (OpComm); eager launches run in program order already
        if any(self.fmts[:3]):
            return self._ulysses_fp8(xs, lo, hi)
        if self.armed or self.tr is None:  # the op sees heads [lo, hi) of every head group: [B, S, W*(hi-lo), D]
            b, s, h, d = xs[0].shape
            self._first(xs[0], len(xs), (b, s, self.world * ((h // self.world if hi is None else hi) - lo), d))
        heads = getattr(self.tr, "ulysses_start_heads", None)  # packs a sub-group straight from the inputs
        if heads is not None:
            buf, work = heads(xs, self.pg, lo, hi)
        else:
            buf, work = self.tr.ulysses_start([layout.ulysses_heads(x, self.world, lo, hi) for x in xs], self.pg)
        return self._launched(buf, work)

    def _ulysses_fp8(self, xs, lo, hi) -> Pending:
        """:meth:`ulysses` with FP8 tensors: one launch per format group of a send buffer packed here; the wait decodes
        straight into the unpacked layout. Signature as the op's: ``[B, S, W*(hi-lo), D']`` of the buffer's dtype."""
        dt = xs[0].dtype
        sends = self._ulysses_sends(xs, lo, hi, layout.ulysses_pack)
        bufs, works = [], []
        for _, idx, send in sends:
            if self.armed or self.tr is None:
                w, b, s, _, hs, d = send.shape
                self._first(send, len(idx), (b, s, w * hs, d))
            buf, work = ulysses_packed_start(self.tr, send, self.pg)
            bufs.append(buf)
            works.append(work)
        work = works[0] if len(works) == 1 else Works(works)
        groups = [(f, idx) for f, idx, _ in sends]
        return self._launched(tuple(bufs), work, lambda b: self._ulysses_decoded(groups, b, dt))

    def ulysses_inverse(self, x, after=None) -> Pending:  # after: as in :meth:`ulysses`
        f, dt, post = self.fmts[3], x.dtype, None
        into = None
        if f:
            x, post = fp8.encode(x, f), (lambda b: self._inverse_decoded(b, dt, f))
            into = lambda b, out: fp8_ulysses.inverse_decode(b.narrow(2, 0, out.shape[1]), dt, f, out=out)  # noqa: E731
        if self.armed or self.tr is None:
            self._first(x, 1)
        buf, work = self.tr.ulysses_inverse_start(x, self.pg)
        return self._launched(buf, work, post, into)


class MeshComm:
    """The comm of a 2-D mode body: ``inner`` (Ulysses) and ``outer`` (AGKV), two comms of one kind; ``world``: O·I."""

    __slots__ = ("inner", "outer", "world")

    def __init__(self, outer, inner):
        self.outer, self.inner = outer, inner
        self.world = outer.world * inner.world

    def drain(self) -> None:
        """:meth:`_Comm.drain` of both comms (after a body raised)."""
        self.inner.drain()
        self.outer.drain()


class _Decoding:
    """Pipelined AGKV with FP8: a work whose wait also decodes rows ``[lo, hi)`` of each (encoded, full) pair, once;
    ``then``: other decodings the wait completes too. Other attributes: the work's."""

    __slots__ = ("work", "pairs", "lo", "hi", "fmt", "then", "done")

    def __init__(self, work, pairs, lo, hi, fmt, then=()):
        self.work, self.pairs, self.lo, self.hi, self.fmt, self.then = work, pairs, lo, hi, fmt, then
        self.done = False

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - Work signature
        self.work.wait()
        self.decode_only()
        for d in self.then:
            d.decode_only()
        return True

    def decode_only(self) -> None:
        """Decode without waiting (the caller waited for a work that covers this one)."""
        if not self.done:
            self.done = True
            for enc, full in self.pairs:
                full[:, self.lo:self.hi].copy_(fp8.decode(enc[:, self.lo:self.hi], full.dtype, self.fmt))

    def __getattr__(self, name):  # cancel, wait_source: the transport's own work
        return getattr(self.work, name)


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
