"""The torch transport: ``torch.distributed`` collectives — NCCL on CUDA, gloo on CPU; works multi-node.

AGKV is one coalesced all-gather per call straight into the final ``[B, S, H, D]`` buffers (per batch row when
B > 1); Ulysses is one ``all_to_all_single`` over a packed buffer of every tensor of the call. Outputs are fresh.
A group that runs CUDA tensors over gloo (``cpu:gloo,cuda:gloo``, e.g. ranks sharing one GPU) is staged through host
memory: gloo's coalesced all-gather and send/recv have no CUDA path (a segfault in ``work.wait()`` with torch 2.11),
so each launch copies its inputs to the host, runs the CPU collective, waits and copies back (synchronous).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..contract import BoundedWork
from ..layout import ulysses_inverse_pack, ulysses_pack
from .base import Arrival, Works, register


class TorchTransport:
    name = "torch"
    slots_per_key = None
    pooled_outputs = False

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def group_reason(self, group: dist.ProcessGroup, device: torch.device) -> str | None:
        return None

    def agkv_start(self, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup):
        if stage_through_host(group, k.device):
            return _staged(_agkv_gather, group, k, v)
        return _agkv_gather(group, k, v)

    def agkv_start_sources(self, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, pieces: int = 1):
        """AGKV by point-to-point sends, one batch (one work) per (peer, piece) so each piece can be waited as it
        lands: at step j = 1..W-1 send to rank+j and receive from rank-j (mod W), in ``pieces`` token ranges;
        returns as :func:`cp_ops.transport.base.agkv_start_sources` (a staged group sends the same on host copies)."""
        if stage_through_host(group, k.device):
            k_full, v_full, arrivals, work = _staged(_agkv_sources, group, k, v, pieces)
            return k_full, v_full, [Arrival(a.src, a.lo, a.hi, work) for a in arrivals], work
        return _agkv_sources(group, k, v, pieces)

    def ulysses_start_heads(self, xs: list[torch.Tensor], group: dist.ProcessGroup, lo: int = 0,
                            hi: int | None = None):
        """Ulysses of heads ``[lo, hi)`` of every head group (``hi=None``: all): ``(buf [W, B, S_local, n, hi - lo, D],
        work)``."""
        return _all_to_all(ulysses_pack(xs, group.size(), lo, hi), group)

    ulysses_start = ulysses_start_heads

    def ulysses_packed_start(self, send: torch.Tensor, group: dist.ProcessGroup):
        """All-to-all of a caller-packed send buffer ``[W, B, S_local, n, Hl, D]``: ``(buf, work)``, same shape."""
        return _all_to_all(send.contiguous(), group)

    def ulysses_inverse_start(self, x: torch.Tensor, group: dist.ProcessGroup):
        return _all_to_all(ulysses_inverse_pack(x, group.size()), group)


def _agkv_gather(group: dist.ProcessGroup, k: torch.Tensor, v: torch.Tensor):
    """:meth:`TorchTransport.agkv_start` on a group that moves ``k``'s device: ``(k_full, v_full, work)``."""
    w = group.size()
    b, s, h, d = k.shape
    k_full = k.new_empty(b, w * s, h, d)
    v_full = v.new_empty(b, w * s, h, d)
    k_in, v_in = k.contiguous(), v.contiguous()
    rows = range(b)  # per batch row (indexing: no comprehension frames, and unlike unbind the GIL stays held)
    work = group.allgather_into_tensor_coalesced([*map(k_full.__getitem__, rows), *map(v_full.__getitem__, rows)],
                                                 [*map(k_in.__getitem__, rows), *map(v_in.__getitem__, rows)])
    return k_full, v_full, BoundedWork(group, work) if k.is_cpu else work  # a CPU collective: the host waits


def _agkv_sources(group: dist.ProcessGroup, k: torch.Tensor, v: torch.Tensor, pieces: int):
    """:meth:`TorchTransport.agkv_start_sources` by point-to-point sends on a group that moves ``k``'s device."""
    w, r = group.size(), group.rank()
    b, s, h, d = k.shape
    k_full = k.new_empty(b, w * s, h, d)
    v_full = v.new_empty(b, w * s, h, d)
    k_in, v_in = k.contiguous(), v.contiguous()
    pieces = max(1, min(pieces, s))
    cuts = [c * s // pieces for c in range(pieces + 1)]
    arrivals, works = [], []
    coalesce = group._get_backend(k.device).supports_coalescing
    for j in range(1, w):
        dst, src = (r + j) % w, (r - j) % w  # group ranks
        for lo, hi in zip(cuts, cuts[1:]):
            if coalesce:  # what dist.batch_isend_irecv does for NCCL, without its per-op Python checks
                group._start_coalescing(k.device)
            else:
                batch = []
            for tag, (x_in, x_full) in enumerate(((k_in, k_full), (v_in, v_full))):
                for i in range(b):
                    a = group.send([x_in[i, lo:hi]], dst, 2 * i + tag)
                    c = group.recv([x_full[i, src * s + lo:src * s + hi]], src, 2 * i + tag)
                    if not coalesce:
                        batch += [a, c]
            work = Works([group._end_coalescing(k.device)] if coalesce else batch)  # gloo p2p: done in wait()
            works.append(work)
            arrivals.append(Arrival(src, src * s + lo, src * s + hi, work))
    return k_full, v_full, arrivals, Works(works)


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup):
    """One ``alltoall_base`` of a contiguous send buffer of W equal slabs (slab t to rank t): ``(recv, work)``."""
    if stage_through_host(group, send.device):
        return _staged(_alltoall_base, send, group)
    return _alltoall_base(send, group)


def _alltoall_base(send: torch.Tensor, group: dist.ProcessGroup):
    recv = torch.empty_like(send)
    work = group.alltoall_base(recv, send, [], [])
    return recv, BoundedWork(group, work) if send.is_cpu else work  # a CPU collective: the host waits


def stage_through_host(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group`` runs GPU ``device``'s tensors over gloo (``cpu:gloo,cuda:gloo``): then every launch is
    staged through host memory (module docstring). Sees through ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s wrapper."""
    if device.type == "cpu":
        return False
    try:
        backend = group._get_backend(device)
    except (RuntimeError, AttributeError):  # no backend registered for the device type
        return False
    name = type(backend).__name__
    if name == "_ProcessGroupWrapper":  # TORCH_DISTRIBUTED_DEBUG=DETAIL: the collectives run on the wrapped backend
        name = type(getattr(backend, "wrapped_pg", backend)).__name__
    return name == "ProcessGroupGloo"


def _staged(launch, *args):
    """``launch(*args)`` on host copies of its tensor arguments, waited there, its tensor outputs copied back to the
    first tensor argument's device; its work replaced by one that orders the waiting stream after those copies."""
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))
    *outs, work = launch(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    work.wait()
    outs = [o.to(dev) if isinstance(o, torch.Tensor) else o for o in outs]
    return (*outs, _Copied(dev))


class _Copied(dist.Work):
    """The work of a launch staged through host memory: ``wait()`` makes the current stream wait (an event) for
    the copies back on the launching stream. A ``dist.Work`` so the ops can register it (``wait_tensor``)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.event, self.device = None, device
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - Work signature
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)  # that device's stream, as NCCL's wait
        return True

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()


transport = register(TorchTransport(), auto_rank=99)
