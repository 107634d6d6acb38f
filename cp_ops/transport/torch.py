"""The torch transport: ``torch.distributed`` collectives — NCCL on CUDA, gloo on CPU; works multi-node.

AGKV is one coalesced all-gather per call, written straight into the final ``[B, S, H, D]`` buffers
(per batch row when B > 1, so no rearranging copy follows). Ulysses is one ``all_to_all_single`` over a
packed buffer carrying every tensor of the call. Outputs are fresh tensors (never pooled).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layout import ulysses_inverse_pack, ulysses_pack
from . import fake_fill
from .base import register


class TorchTransport:
    name = "torch"
    slots_per_key = None
    pooled_outputs = False

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None

    def group_reason(self, group: dist.ProcessGroup, device: torch.device) -> str | None:
        return None

    def agkv_start(self, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup):
        w = group.size()
        b, s, h, d = k.shape
        k_full = k.new_empty(b, w * s, h, d)
        v_full = v.new_empty(b, w * s, h, d)
        k_in, v_in = k.contiguous(), v.contiguous()
        outs = [k_full[i] for i in range(b)] + [v_full[i] for i in range(b)]
        ins = [k_in[i] for i in range(b)] + [v_in[i] for i in range(b)]
        # the zero-communication bound: on a fake group cp_ops writes the outputs (one copy per tensor) instead
        work = fake_fill.gather("allgather_into_tensor_coalesced", group, outs, ins) if fake_fill.ACTIVE else None
        if work is None:
            work = group.allgather_into_tensor_coalesced(outs, ins)
        return k_full, v_full, work

    def agkv_start_sources(self, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, pieces: int = 1):
        """AGKV by point-to-point sends, one batch (one work) per (peer, piece), so each piece can be waited as
        it lands: at step j = 1..W-1 this rank sends to rank+j and receives from rank-j (mod W), its block split
        into ``pieces`` token ranges. Returns as :func:`cp_ops.transport.base.agkv_start_sources` (own block of
        ``k_full``/``v_full`` unwritten). On NCCL the batches run in issue order, so pieces land in list order."""
        from .base import Arrival

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
                work = _Works([group._end_coalescing(k.device)] if coalesce else batch)
                works.append(work)
                arrivals.append(Arrival(src, src * s + lo, src * s + hi, work))
        if fake_fill.ACTIVE:  # every received block (and this rank's own, as the fake all-gathers write it)
            for i in range(b):
                fake_fill.fill("recv", group, k_full[i], k_in[i])
                fake_fill.fill("recv", group, v_full[i], v_in[i])
        return k_full, v_full, arrivals, _Works(works)

    def ulysses_start(self, xs: list[torch.Tensor], group: dist.ProcessGroup):
        return _all_to_all(ulysses_pack(xs, group.size()), group)

    def ulysses_start_heads(self, xs: list[torch.Tensor], group: dist.ProcessGroup, lo: int, hi: int):
        """:meth:`ulysses_start` of heads ``[lo, hi)`` of every rank's head group (pipelined Ulysses' sub-group):
        ``(buf [W, B, S_local, n, hi - lo, D], work)``, packed straight from the whole tensors."""
        return _all_to_all(ulysses_pack(xs, group.size(), lo, hi), group)

    def ulysses_packed_start(self, send: torch.Tensor, group: dist.ProcessGroup):
        """All-to-all of a send buffer ``[W, B, S_local, n, Hl, D]`` packed by the caller
        (``cp_ops::ulysses_packed_start``): ``(buf, work)``, ``buf`` of the same shape."""
        return _all_to_all(send.contiguous(), group)

    def ulysses_inverse_start(self, x: torch.Tensor, group: dist.ProcessGroup):
        return _all_to_all(ulysses_inverse_pack(x, group.size()), group)


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup):
    """One ``alltoall_base`` of a contiguous send buffer of W equal slabs (slab t to rank t): ``(recv, work)``, what
    every Ulysses launch of this transport ends in (the fake group's output written where it writes nothing)."""
    recv = torch.empty_like(send)
    work = group.alltoall_base(recv, send, [], [])
    if fake_fill.ACTIVE:
        fake_fill.fill("alltoall_base", group, recv, send)
    return recv, work


class _Works:
    """Several works as one: ``wait()`` waits for each (CUDA: the current stream waits; CPU: the host)."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - Work signature
        for w in self.works:
            w.wait()
        self.works = []
        return True


transport = register(TorchTransport(), auto_rank=99)
