"""Pipelined AGKV: attend the local K/V while the peers' K/V are in flight, then each peer's piece as it lands,
and merge the partial outputs by their log-sum-exp (LSE) in fp32.

Stages (``chunks = k``, for k ≥ 2): stage 0 attends the local Q against this rank's own K/V (no communication
needed); the peers' pieces — each peer's block split into ``ceil((k-1)/(W-1))`` pieces where the transport can
(the torch transport can; the fast transport lands whole blocks, one signal per source) — are taken in arrival
order and cut into ``k-1`` consecutive stages; stage i waits for its pieces only and attends the local Q against
them (one attention per run of adjacent tokens). The ≥ 2 partial outputs are merged once at the end by
:func:`cp_ops.modes.lse_merge.merge` (one fused Triton kernel on CUDA). With communication time C and
attention time A over all W blocks, transport-then-attend costs ``C + A``; this costs about
``max(A/W, first piece) + ...`` — communication hides under attention except the first piece's remainder.

Everything runs inside one ``torch.library`` op, ``cp_ops::agkv_pipelined_attention`` (:mod:`cp_ops._library`),
synchronous for the caller's stream: its output is valid on return, needs no ``wait_tensor``, and its fake kernel
is exact (``[B, S_local, H, D]``, contiguous, q's dtype), so ``torch.compile(fullgraph=True)`` traces it as one
node. (Why one op: per-source waits are views of one gathered buffer, and c10d's work registry keys waits by
storage, one work per storage; a launch/wait split would lose the per-source order.)

Method: AGKV as in Megatron-LM context parallelism / xDiT; the LSE merge as in ring attention (Liu et al.,
2023, arXiv:2310.01889) and flash-decoding.
"""

from __future__ import annotations

import math

import torch

from ..transport import base as transport_base
from .attention_lse import attention_with_lse
from .lse_merge import merge


def stage_plan(world_size: int, chunks: int) -> tuple[int, int]:
    """``(pieces per peer, stages after the local one)`` for ``chunks`` ≥ 1 on W ranks (chunks 1 and 2 alike:
    local, then all peers)."""
    peers = world_size - 1
    later = max(1, chunks - 1)
    return max(1, math.ceil(later / peers)), later


def _split(items: list, n: int) -> list[list]:
    """``items`` in ``n`` consecutive, near-equal, non-empty groups (fewer when there are fewer items)."""
    n = max(1, min(n, len(items)))
    cuts = [i * len(items) // n for i in range(n + 1)]
    return [items[a:b] for a, b in zip(cuts, cuts[1:])]


def _runs(arrivals) -> list[tuple[int, int]]:
    """Token ranges of ``arrivals`` with adjacent ranges joined (one attention per run)."""
    out: list[list[int]] = []
    for a in sorted(arrivals, key=lambda a: a.lo):
        if out and out[-1][1] == a.lo:
            out[-1][1] = a.hi
        else:
            out.append([a.lo, a.hi])
    return [(lo, hi) for lo, hi in out]


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, transport, scale: float | None,
        chunks: int) -> torch.Tensor:
    """The real kernel of ``cp_ops::agkv_pipelined_attention`` (``transport``: a Transport object)."""
    pieces, later = stage_plan(group.size(), chunks)
    k_full, v_full, arrivals, work = transport_base.agkv_start_sources(transport, k, v, group, pieces)
    outs, lses = [], []
    o, lse = attention_with_lse(q, k, v, scale)  # own block: under the transfer
    outs.append(o)
    lses.append(lse)
    stages = _split(arrivals, later)
    for i, stage in enumerate(stages):
        if i + 1 < len(stages):
            for a in stage:
                a.work.wait()
        else:  # the last stage waits for everything that is left: one wait (it also orders the reads of k, v)
            work.wait()
        for lo, hi in _runs(stage):
            o, lse = attention_with_lse(q, k_full[:, lo:hi], v_full[:, lo:hi], scale)
            outs.append(o)
            lses.append(lse)
    return merge(outs, lses, q.dtype).contiguous()


def agkv_pipelined_attention(q, k, v, *, world_size: int, group_name: str, transport: str, scale=None,
                             chunks: int = 2) -> torch.Tensor:
    """Pipelined AGKV (see the module docstring). Shapes as :func:`cp_ops.attention`; ``chunks`` ≥ 2."""
    return torch.ops.cp_ops.agkv_pipelined_attention(q, k, v, world_size, group_name, transport, scale, chunks)


def _agkv_pipelined_eager(q, k, v, pg, transport, scale, chunks) -> torch.Tensor:
    """Eager pipelined AGKV without the dispatcher (cp_ops._eager): :func:`run` (the op's real kernel)."""
    return run(q, k, v, pg, transport, scale, chunks)


# the rank contract's signature of an eager call: that of cp_ops::agkv_pipelined_attention (extra = chunks)
_agkv_pipelined_eager.signature = lambda q, k, v, chunks: ("cp_ops::agkv_pipelined_attention", q, chunks, 0)
agkv_pipelined_attention.eager = _agkv_pipelined_eager
