"""Pipelined AGKV: attend the local K/V while the peers' K/V are in flight, then each peer's piece as it lands,
and merge the partial outputs by their log-sum-exp (LSE) in fp32 (:func:`cp_ops.kernels.lse_merge.merge`).

Stages (``chunks = k ≥ 2``): stage 0 attends this rank's own K/V; the peers' pieces (each block split into
``ceil((k-1)/(W-1))`` pieces where the transport can; the fast transport lands whole blocks) are taken in arrival
order and cut into ``k-1`` stages, each waiting for its pieces only (one attention per run of adjacent tokens).
Communication hides under attention except the first piece's remainder.

Traced code runs this body inside one op, ``cp_ops::agkv_pipelined_attention`` (:mod:`cp_ops.ops`), whose real
kernel calls it with the direct comm: per-source waits are views of one gathered buffer, and c10d keys waits by
storage, so a launch/wait split would lose the per-source order. Uneven shards: the padded blocks travel, each stage
attends the real rows that landed. No key mask (the LSE kernels take none: the plan runs chunks = 1).

Method: AGKV as in Megatron-LM / xDiT; the LSE merge as in ring attention (arXiv:2310.01889) and flash-decoding.
"""

from __future__ import annotations

import math

import torch

from ..kernels import attention_with_lse, merge
from ..kernels.lse import dense_rows


def stage_plan(world_size: int, chunks: int) -> tuple[int, int]:
    """``(pieces per peer, stages after the local one)`` for ``chunks`` ≥ 1 on W ranks (1 and 2: local, then peers)."""
    peers = world_size - 1
    later = max(1, chunks - 1)
    return max(1, math.ceil(later / peers)), later


def _split(items: list, n: int) -> list[list]:
    """``items`` in ``n`` consecutive, near-equal, non-empty groups (fewer when there are fewer items)."""
    n = max(1, min(n, len(items)))
    cuts = [i * len(items) // n for i in range(n + 1)]
    return [items[a:b] for a, b in zip(cuts, cuts[1:])]


def _runs(arrivals, shards=None) -> list[tuple[int, int]]:
    """Token ranges of ``arrivals`` (clipped to each source's real rows under ``shards``), adjacent ranges joined (one
    attention per run), empty ones dropped."""
    out: list[list[int]] = []
    for a in sorted(arrivals, key=lambda a: a.lo):
        lo, hi = a.lo, a.hi
        if shards is not None:
            blo, bhi = shards.block(a.src)
            lo, hi = max(lo, blo), min(hi, bhi)
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def agkv_pipelined(q, k, v, comm, *, scale=None, chunks: int = 2, shards=None, key_mask=None) -> torch.Tensor:
    """The pipelined AGKV body (:mod:`cp_ops.modes`), ``chunks`` ≥ 2: ``[B, S_local, H, D]`` → ``[B, S_local, H, D]``
    (contiguous, q's dtype). ``comm`` must offer ``agkv_sources`` (the direct comm)."""
    if key_mask is not None:
        raise ValueError("pipelined AGKV takes no key_mask (its LSE kernels take no mask); use chunks=1")
    pieces, later = stage_plan(comm.world, chunks)
    kp, vp = (k, v) if shards is None else (shards.pad(k), shards.pad(v))
    k_full, v_full, arrivals, work = comm.agkv_sources(kp, vp, pieces)
    if q.shape[1] == 0:  # a rank without tokens (uneven shards) still sends its block: nothing to attend
        work.wait()
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    q, k, v = dense_rows(q, k, v)  # once for every kernel call below (the transport's buffers are dense)
    outs, lses = [], []
    if k.shape[1]:
        o, lse = attention_with_lse(q, k, v, scale, dense=True)  # own block: under the transfer
        outs.append(o)
        lses.append(lse)
    stages = _split(arrivals, later)
    for i, stage in enumerate(stages):
        if i + 1 < len(stages):
            for a in stage:
                a.work.wait()
        else:  # the last stage waits for everything that is left: one wait (it also orders the reads of k, v)
            work.wait()
        for lo, hi in _runs(stage, shards):
            o, lse = attention_with_lse(q, k_full[:, lo:hi], v_full[:, lo:hi], scale, dense=True)
            outs.append(o)
            lses.append(lse)
    if not stages:
        work.wait()
    return merge(outs, lses, q.dtype).contiguous()
