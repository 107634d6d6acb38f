"""Which pipelined variant each mode has, and how many stages (``chunks``) a call uses.

``cp_ops.attention(..., chunks=c)``: ``c = 1`` runs the mode as transport-then-attend (bitwise equal to one
device); ``c ≥ 2`` runs the mode's pipelined variant in c stages (:mod:`.agkv_pipelined`,
:mod:`.ulysses_pipelined`); ``c = None`` asks :func:`choose_chunks`.

:func:`choose_chunks` is the hook for the measured choice (issue 9, item 4: measure the variants on first
use, agree over the ranks, cache on disk). Until that lands it returns 1 — transport-then-attend, the path
measured and bitwise equal to one device — so the pipelined variants run only when asked for (``chunks=k``).
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


def check_chunks(chunks) -> None:
    """``chunks`` must be None or an int ≥ 1 (ValueError naming the value)."""
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be None (heuristic) or an int >= 1 (1 = transport-then-attend); got {chunks!r}")


def choose_chunks(mode: str, world_size: int, q: torch.Tensor, transport: str = "auto") -> int:
    """The stage count for a call whose ``chunks`` is None (see the module docstring). ``q``: ``[B, S_local, H, D]``.

    Returns 1 (transport-then-attend) for now: the pipelined variants are opt-in (``chunks=k``) until the
    measured per-shape choice (issue 9, item 4) decides from numbers taken on the GPU."""
    del mode, world_size, q, transport  # the measured choice will key on them
    return 1
