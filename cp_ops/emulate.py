"""FP8 communication on ONE device: what W > 1 ranks compute with ``comm_dtype``, without a second rank.

With ``CP_OPS_EMULATE_COMM=1`` (:data:`cp_ops.config.settings` ``emulate_comm``), a :func:`cp_ops.attention` call on
a group of one rank with FP8 formats (:mod:`cp_ops.comm_dtype`) round-trips every tensor that W > 1 ranks would send
through the codec exactly as the transports do (:func:`cp_ops.kernels.fp8.round_trip`: the same encode and decode),
then attends: AGKV decodes K and V after the gather, Ulysses Q, K, V after the all-to-all and O after the way back.

Why W does not matter: the codec's scales are per (token, head) row, so a row is encoded the same whichever rank
holds it, and at ``chunks = 1`` every rank's block — its own included, which travels in the same packed buffer —
goes through the codec. So this is the W-rank result at chunks = 1 for any W (up to the attention kernel's rounding
by call shape: AGKV attends per query block, Ulysses per head group). The pipelined AGKV (chunks ≥ 2) keeps the own
block exact, so its error is at most this one's. Uneven shards do not change it either (padding rows are dropped).
"""

from __future__ import annotations

from .kernels import local_attention
from .kernels.fp8 import round_trip


def attention(q, k, v, scale, key_mask, fmts, kv_trips: int = 1):
    """``[B, S, H, D]`` → ``[B, S, H, D]``: attention with q/k/v round-tripped through the formats ``fmts``
    (:func:`cp_ops.comm_dtype.for_mode`'s 4-tuple; '' = not encoded), then o. ``kv_trips``: how many links K and V
    cross, each through the codec (2 on a 2-D mesh: the inner all-to-all, then the outer gather)."""
    fq, fk, fv, fo = fmts
    q = round_trip(q, fq) if fq else q
    for _ in range(kv_trips):
        k = round_trip(k, fk) if fk else k
        v = round_trip(v, fv) if fv else v
    out = local_attention(q, k, v, scale, key_mask)
    return round_trip(out, fo) if fo else out
