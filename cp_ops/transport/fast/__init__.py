"""The fast transport: one Hopper node, direct peer writes over NVLink/P2P into symmetric buffers.

:class:`FastTransport` (registered as ``'fast'``) has the contract of :mod:`cp_ops.transport.torch`; ``work.wait()``
makes the current CUDA stream wait (no host block). Each rank writes its chunk straight into every peer's *final*
buffer (pitched copies on the copy engine or an SM kernel, the fan-out measured per shape at its first call), then
raises a per-call, per-source arrival flag there (:meth:`FastTransport.wait_source`). Modules and faults:
``docs/fast_transport.md``; settings (``CP_OPS_FAST_*``): ``docs/settings.md``.

Outputs are views of pooled buffers, valid until the second-next fast call of the same role and shape
(``slots_per_key`` = 2); a launch that would overwrite an output not yet waited raises. At most 256 fast calls may
be in flight. Under CUDA graphs a shape can be captured once it ran eagerly; a captured call keeps its flag slot
while its graph lives and its pool buffers until :meth:`FastTransport.shutdown`. Bitwise equal to the torch
transport; on 2x H200 AGKV takes 0.69-0.78x the NCCL all-gather's time, Ulysses 0.49-0.52x the torch transport's
(``benchmarks/results/transfer/table.md``).
"""

from __future__ import annotations

import importlib.util
import logging
import weakref

import torch
import torch.distributed as dist

from ... import config
from ..base import forget_groups, register, source_arrivals
from . import collective

log = logging.getLogger("cp_ops")


def _prep(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` contiguous and 16-byte aligned (a copy only where it is not), and its address."""
    t = t.contiguous()
    p = t.data_ptr()
    if p % 16:
        t = t.clone()
        p = t.data_ptr()
    return t, p


class FastTransport:
    """The fast transport (module docstring); the registered instance is :data:`transport`. ``lane``: the process's
    one :class:`~.lane.Lane`, None before the first fast call."""

    name = "fast"
    device_types = ("cuda",)
    single_node = True  # 'auto' does not try it for a group on several nodes (cp_ops.node)
    slots_per_key = 2
    pooled_outputs = True

    def __init__(self):
        self.lane = None
        self._lane_group = None  # the last group object found to be the lane's
        self._unfit: dict = {}  # group ranks -> why the group cannot host the lane
        self._reason_cache: dict = {}  # device index -> why the device cannot run fast (or None)
        self._works: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # output data_ptr -> work

    # ---- availability ---------------------------------------------------------------------------
    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why the fast transport cannot run for tensors on ``device``; ``None`` when it can. Checked in order:
        CUDA tensors; a GPU; compute capability 9.0; nvshmem4py importable (unless ``CP_OPS_FAST_HEAP=ipc``); the
        CUDA extension built (here on the first call, ~1 min, then cached). Group requirements: :meth:`group_reason`."""
        device = torch.device(device)
        if device.type != "cuda":
            return (f"the tensors are on '{device.type}', and the fast transport moves CUDA tensors between "
                    "Hopper (sm_90) GPUs of one node over NVLink/P2P; on this device use transport='torch' "
                    "(transport='auto' picks it)")
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False (no GPU, or a CPU-only build of torch)"
        idx = torch.cuda.current_device() if device.index is None else device.index
        if idx not in self._reason_cache:
            self._reason_cache[idx] = self._device_reason(idx)
        return self._reason_cache[idx]

    def _device_reason(self, idx: int) -> str | None:
        cap = torch.cuda.get_device_capability(idx)
        if cap != (9, 0):
            name = torch.cuda.get_device_name(idx)
            return f"GPU {idx} ({name}) has compute capability {cap[0]}.{cap[1]}; the fast transport needs 9.0 (Hopper)"
        if config.settings.fast_heap == "nvshmem" and importlib.util.find_spec("nvshmem") is None:
            return ("nvshmem4py is not installed: pip install 'cp_ops[fast]' (nvshmem4py-cu13), "
                    "or set CP_OPS_FAST_HEAP=ipc to use CUDA IPC symmetric buffers")
        from ... import _ext

        _, why = _ext.load()
        return why

    def group_reason(self, group, device: torch.device) -> str | None:
        """Why ``group`` cannot use the fast transport, or None (then the lane exists for it). Collective on its
        first call (cached after): availability, the group probe and each start stage are agreed over the ranks,
        so a failure on one rank is every rank's verdict (bounded by the timeout). The process has one lane: the
        first group (of width ``fast_lane_width`` when set) that starts it; other groups get a reason naming it."""
        device = torch.device(device)
        if device.type != "cuda":
            return self.unavailable_reason(device)
        s = config.settings
        width = group.size()
        ranks = dist.get_process_group_ranks(group)
        if self.lane is not None:
            if self.lane.ranks == ranks:
                return None
            return (f"the process's one fast lane is CP group {list(self.lane.ranks)} (width {self.lane.world}); this "
                    f"group {ranks} (width {width}) is not it (set CP_OPS_FAST_LANE_WIDTH to pick the width that uses "
                    "the lane)")
        if s.fast_lane_width is not None and width != s.fast_lane_width:
            return (f"this group {ranks} has width {width}, and CP_OPS_FAST_LANE_WIDTH={s.fast_lane_width} is the width "
                    "that uses the fast lane")
        key = tuple(ranks)
        if key not in self._unfit:
            try:
                self.lane = self._start(group, device)
                return None
            except collective.StartFailed as e:
                self._unfit[key] = str(e)
        return self._unfit[key]

    def _start(self, group, device: torch.device):
        """Start the lane on ``group`` (collective, bounded; every rank gets the same ``collective.StartFailed``)."""
        from ... import _ext
        from . import start

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "cp_ops fast transport: the first fast call on this group is being captured into a CUDA graph, but "
                "the lane starts collectively (group-wide exchanges, symmetric allocations, device synchronization), "
                "which a capture cannot contain: run the captured code once eagerly before capturing "
                "(torch.cuda.graph warm-up; torch.compile(mode='reduce-overhead') does this)")
        exchange = collective.Exchange(group, "start")  # bounded, agreed exchanges (every rank makes the same ones)
        try:
            local = self.unavailable_reason(device)
            collective.agree_outcome(exchange, "the fast transport's availability check", local)
            ext, _ = _ext.load()
            reason, fabric = start.probe_group(group, device, ext, exchange)
            if reason is not None:
                raise collective.StartFailed(reason)
            return start.start(group, device, ext, fabric=fabric, slots_per_key=self.slots_per_key, exchange=exchange,
                               lane_exchange=collective.Exchange(group, "lane"))
        except collective.PeerTimeout as e:  # outside a stage (the group probe, the NVSHMEM unique-ID exchange)
            raise collective.StartFailed(f"cp_ops: transport='fast' could not start for CP group "
                                         f"{dist.get_process_group_ranks(group)}: {e}") from None

    def _lane_for(self, group):
        """The lane for ``group``, started (collective) when none exists; RuntimeError naming why it cannot."""
        lane = self.lane
        if lane is not None:
            if group is self._lane_group:  # the group that matched last time (no rank list built per call)
                return lane
            if lane.ranks == dist.get_process_group_ranks(group):
                self._lane_group = group
                return lane
        reason = self.group_reason(group, torch.device("cuda", torch.cuda.current_device()))
        if reason is not None:
            raise RuntimeError(f"transport='fast' cannot run for this group: {reason}")
        return self.lane

    # ---- errors, settings, lifecycle --------------------------------------------------------------
    def check(self) -> None:
        """Raise RuntimeError if a device wait of the lane timed out (:meth:`.lane.Lane.check`); no device sync."""
        if self.lane is not None:
            self.lane.check()

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()`` then :meth:`check` (every device wait ends within ``timeout_s``)."""
        torch.cuda.synchronize()
        self.check()

    def configure(self, *, pool_gb: float | None = None, heap: str | None = None, path: str | None = None,
                  lane_width: int | None = None, tune: bool | None = None) -> None:
        """Change the ``fast_*`` fields of :data:`cp_ops.config.settings`: ``pool_gb``/``heap``/``lane_width`` only
        while no lane exists (else RuntimeError), ``path``/``tune`` any time. An unknown heap or path name raises
        :class:`cp_ops.config.ConfigError` (a ValueError)."""
        if self.lane is not None and (pool_gb is not None or heap is not None or lane_width is not None):
            raise RuntimeError("pool_gb, heap and lane_width are fixed while the fast lane is live; call "
                               "fast.shutdown() first")
        changes = {"fast_pool_gb": pool_gb, "fast_heap": heap, "fast_path": path, "fast_lane_width": lane_width,
                   "fast_tune": tune}
        config.configure(**{k: v for k, v in changes.items() if v is not None})

    def describe(self) -> dict:
        """What ``cp-ops env`` prints (availability, settings, lane, pool, decisions); never builds the extension
        or touches the GPU anew."""
        s = config.settings
        if torch.cuda.is_available():
            why = self._reason_cache.get(torch.cuda.current_device(), "not checked yet in this process")
        else:
            why = self.unavailable_reason(torch.device("cpu"))
        return {
            "settings": {"pool_gb": s.fast_pool_gb, "heap": s.fast_heap, "path": s.fast_path,
                         "lane_width": s.fast_lane_width or "first CP group used", "tune": s.fast_tune},
            "nvshmem4py": importlib.util.find_spec("nvshmem") is not None,
            "unavailable_reason": why,
            "lane": self.lane.describe() if self.lane is not None else None,
        }

    def shutdown(self) -> None:
        """Release the lane, pool and NVSHMEM runtime (collective over the lane's group); a later fast call starts
        a new lane. Exiting without it is safe: nothing collective runs at exit."""
        if self.lane is None:
            return
        lane, self.lane = self.lane, None
        self._lane_group = None
        self._unfit.clear()
        self._works.clear()
        forget_groups()
        lane.close()

    def wait_source(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Make the current stream wait only for group rank ``src``'s chunk of the fast output ``t``; returns
        ``t``. Raises KeyError when ``t`` is not the output of a pending fast call."""
        self._works[t.data_ptr()].wait_source(src)
        return t

    # ---- launches -------------------------------------------------------------------------------
    def _launch(self, lane, key, bufs, make_descs, inputs):
        """A pool slot per buffer (role, shape, dtype), descriptors, launch (failed: slots back) -> (outputs, work)."""
        call = lane.next_call()
        capturing = lane.capturing()
        got = []
        try:
            for role, shape, dtype in bufs:
                got.append(lane.pool.get(role, shape, dtype, call, capturing))
            descs = make_descs([g[1] for g in got])
            outs = [g[0] for g in got]
            # the outputs' bytes, poisoned (NaN) on the device when a wait of this call times out
            work = lane.launch(key, descs, inputs, [g[2] for g in got],
                               outputs=[(o.data_ptr(), o.numel() * o.element_size()) for o in outs])
        except BaseException:
            for g in got:
                lane.pool.consumed(g[2])
            raise
        works = self._works
        for p in getattr(work, "ptrs", ()):  # a reused work: its previous outputs no longer map to it
            if works.get(p) is work:
                del works[p]
        ptrs = tuple(o.data_ptr() for o in outs)
        for p in ptrs:
            works[p] = work
        if hasattr(work, "ptrs"):
            work.ptrs = ptrs
        return outs, work

    def agkv_start(self, k: torch.Tensor, v: torch.Tensor, group, under_compute: bool = False):
        """All-gather K and V ``[B, S_local, H, D]`` into ``[B, W*S_local, H, D]`` each (tokens in rank order).

        ``under_compute``: the transfer runs under compute the caller issues next (pipelined AGKV): with
        ``CP_OPS_FAST_PATH=auto`` only copy-engine fan-outs are chosen (on 2x H200 an SM copy ran beside the
        attention, not under it), cached apart; this rank's own block of the outputs is left unwritten.

        Returns ``(k_full, v_full, work)`` (pooled outputs). Raises RuntimeError when the fast transport cannot run."""
        lane = self._lane_for(group)
        w, r = lane.world, lane.rank
        b, s, h, d = k.shape
        (k, kp), (v, vp) = _prep(k), _prep(v)
        row = s * h * d * k.element_size()
        pitch = w * row
        off = r * row

        def descs(bases):
            kb, vb = bases
            return [[] if under_compute and t == r else  # the pipelined caller reads its own block from k, v
                    [(kb[t] + off, kp, row, b, pitch, row), (vb[t] + off, vp, row, b, pitch, row)] for t in range(w)]

        full = (b, w * s, h, d)
        key = ("agkv", b, s, h, d, str(k.dtype)) + (("under_compute",) if under_compute else ())
        (kf, vf), work = self._launch(lane, key, [("agkv.k", full, k.dtype), ("agkv.v", full, v.dtype)], descs,
                                      [k, v])
        return kf, vf, work

    def agkv_start_sources(self, k: torch.Tensor, v: torch.Tensor, group, pieces: int = 1):
        """:meth:`agkv_start` with ``under_compute=True``, each peer's whole block waited on its own arrival flag
        (``pieces`` is ignored). Returns as :func:`cp_ops.transport.base.agkv_start_sources`."""
        kf, vf, work = self.agkv_start(k, v, group, under_compute=True)
        lane = self._lane_for(group)
        return kf, vf, source_arrivals(work, lane.world, lane.rank, k.shape[1]), work

    def ulysses_start_heads(self, xs: list[torch.Tensor], group, lo: int = 0, hi: int | None = None):
        """Sequence -> heads all-to-all of n tensors ``[B, S_local, H, D]`` into ``[W, B, S_local, n, hi - lo, D]``
        (:func:`cp_ops.layout.ulysses_pack`'s layout after the all-to-all; index 0 = source rank) of heads
        ``[lo, hi)`` of every head group (``hi=None``: all). Returns ``(buf, work)``; raises as :meth:`agkv_start`."""
        lane = self._lane_for(group)
        w, r = lane.world, lane.rank
        prepped = [_prep(x) for x in xs]
        xs = [x for x, _ in prepped]
        b, s, h, d = xs[0].shape
        n, hl, es = len(xs), h // w, xs[0].element_size()
        hi = hl if hi is None else hi
        hs = hi - lo  # heads per group that travel
        slab = b * s * n * hs * d * es
        hb = hs * d * es
        gb = hl * d * es  # bytes of one head group in a token row of an input
        rows, dpitch, spitch = b * s, n * hb, h * d * es
        # per input: (offset of its slot in this rank's slab, address of its heads [lo, hi) of head group 0)
        parts = [(r * slab + i * hb, p + lo * d * es) for i, (_, p) in enumerate(prepped)]

        def descs(bases):
            (ub,) = bases
            return [[(ub[t] + o, p + t * gb, hb, rows, dpitch, spitch) for o, p in parts] for t in range(w)]

        key = ("ulysses", b, s, h, d, n, str(xs[0].dtype)) if hs == hl else \
            ("ulysses_heads", b, s, h, d, n, lo, hi, str(xs[0].dtype))
        (buf,), work = self._launch(lane, key, [("ulysses", (w, b, s, n, hs, d), xs[0].dtype)], descs, xs)
        return buf, work

    ulysses_start = ulysses_start_heads

    def ulysses_packed_start(self, send: torch.Tensor, group):
        """All-to-all of a caller-packed send buffer ``[W, B, S_local, n, Hl, D]``: slab t to rank t, one copy per
        peer, into ``buf`` of the same shape (slab t from rank t). Its own pool role (apart from the same-shape
        buffers of :meth:`ulysses_inverse_start`). Returns ``(buf, work)``; raises as :meth:`agkv_start`."""
        lane = self._lane_for(group)
        w, r = lane.world, lane.rank
        send, sp = _prep(send)
        slab = send[0].numel() * send.element_size()

        def descs(bases):
            (ub,) = bases
            return [[(ub[t] + r * slab, sp + t * slab, slab, 1, slab, slab)] for t in range(w)]

        shape = tuple(send.shape)
        (buf,), work = self._launch(lane, ("ulysses_packed",) + shape + (str(send.dtype),),
                                    [("ulysses_packed", shape, send.dtype)], descs, [send])
        return buf, work

    def ulysses_inverse_start(self, x: torch.Tensor, group):
        """Heads -> sequence all-to-all of ``[B, S, H/W, D]`` into ``[W, B, S/W, H/W, D]`` (index 0 = source rank; the
        layout of :func:`cp_ops.layout.ulysses_inverse_pack`). Returns ``(buf, work)``; raises as :meth:`agkv_start`."""
        lane = self._lane_for(group)
        w, r = lane.world, lane.rank
        x, xp = _prep(x)
        b, s, hl, d = x.shape
        sl, es = s // w, x.element_size()
        blk = sl * hl * d * es
        off, spitch = r * b * blk, s * hl * d * es

        def descs(bases):
            (ub,) = bases
            return [[(ub[t] + off, xp + t * blk, blk, b, blk, spitch)] for t in range(w)]

        (buf,), work = self._launch(lane, ("ulysses_inv", b, s, hl, d, str(x.dtype)),
                                    [("ulysses_inv", (w, b, sl, hl, d), x.dtype)], descs, [x])
        return buf, work


transport: FastTransport = register(FastTransport(), auto_rank=0)


# ---- module-level helpers (the CLI, `cp-ops env`, tests and benchmarks call these) ----------------
def unavailable_reason(device_type: str, device_index: int | None = None) -> str | None:
    """:meth:`FastTransport.unavailable_reason` for ``device_type`` (and index)."""
    return transport.unavailable_reason(torch.device(device_type, device_index) if device_index is not None
                                        else torch.device(device_type))


def configure(**kw) -> None:
    """:meth:`FastTransport.configure` (``fast_lane_width`` is accepted as an alias of ``lane_width``)."""
    if "fast_lane_width" in kw:
        kw["lane_width"] = kw.pop("fast_lane_width")
    transport.configure(**kw)


describe = transport.describe
shutdown = transport.shutdown
check = transport.check
