"""FP8 communication on ONE device (``CP_OPS_EMULATE_COMM=1``): a group of one rank round-trips every tensor W > 1 ranks
would send through the codec, then attends — the W-rank result at chunks = 1 (docs/fp8.md, "Accuracy on one device")."""

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
