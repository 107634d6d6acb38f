"""Which pipelined variant each mode has, and how many stages (``chunks``) a call uses.

``cp_ops.attention(..., chunks=c)``: ``c = 1`` runs the mode as transport-then-attend (bitwise equal to one
device); ``c ≥ 2`` runs the mode's pipelined variant in c stages (:mod:`.agkv_pipelined`,
:mod:`.ulysses_pipelined`); ``c = None`` asks :func:`choose_chunks`.

:func:`choose_chunks` is the hook for the measured choice (issue 9, item 4: measure the variants on first
use, agree over the ranks, cache on disk). Until then it is this heuristic, a pure function of the shape so
that every rank picks the same:

* CPU, or fewer than 4096 tokens in the whole sequence (W·S_local): 1 — pipelining's extra kernels and the
  merge cost more than the transfer they hide.
* AGKV: W stages (the local block, then one per peer) — on H200 the transfer of one peer's block takes about
  as long as attending one block, so a stage per block hides all but the first.
* Ulysses: 2 when each rank attends at least 2 heads (H/W ≥ 2), else 1.
"""

from __future__ import annotations

from typing import Callable

import torch

from .agkv_pipelined import agkv_pipelined_attention
from .ulysses_pipelined import ulysses_pipelined_attention

#: mode name → its pipelined variant, called as ``fn(q, k, v, *, world_size, group_name, transport, scale, chunks)``.
PIPELINED: dict[str, Callable[..., torch.Tensor]] = {
    "agkv": agkv_pipelined_attention,
    "ulysses": ulysses_pipelined_attention,
}
MIN_TOKENS = 4096


def check_chunks(chunks) -> None:
    """``chunks`` must be None or an int ≥ 1 (ValueError naming the value)."""
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be None (heuristic) or an int >= 1 (1 = transport-then-attend); got {chunks!r}")


def choose_chunks(mode: str, world_size: int, q: torch.Tensor, transport: str = "auto") -> int:
    """The stage count for a call whose ``chunks`` is None (see the module docstring). ``q``: ``[B, S_local, H, D]``.

    Returns 1 when ``mode`` has no pipelined variant."""
    del transport  # the measured choice (item 4) will key on it
    if mode not in PIPELINED or q.device.type != "cuda" or world_size * q.shape[1] < MIN_TOKENS:
        return 1
    if mode == "agkv":
        return world_size
    return 2 if q.shape[2] // world_size >= 2 else 1
