"""Which pipelined variant each mode has, and how many stages (``chunks``) a call uses.

``cp_ops.attention(..., chunks=c)``: ``c = 1`` runs the mode as transport-then-attend (bitwise equal to one
device); ``c ≥ 2`` runs the mode's pipelined variant in c stages (:mod:`.agkv_pipelined`,
:mod:`.ulysses_pipelined`); ``c = None`` is decided by :mod:`.tune` (measured on first use), or by
:func:`choose_chunks` (the heuristic) where measuring is off.
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
    """The heuristic stage count for ``chunks=None`` when measuring is off (``CP_OPS_TUNE_MODES=0``) or impossible
    (:mod:`.tune`). ``q``: ``[B, S_local, H, D]`` (only its shape is read).

    Rule: 1 (transport-then-attend, bitwise equal to one device) for every mode and shape. Source: CP2 on 2x H200,
    bf16, B=1, H=40, D=128, steady state (benchmarks/results/2026-11-29_h200x2_torch2.11_cu130/
    pipelined_gloo_check_0019c2b.md): Ulysses with 2 or 4 head sub-groups was slower than 1 at every S (4K to
    75600; 2-4x slower at 4K); AGKV with 2 or 4 stages was slower at 4K (1.04-1.11 ms vs 0.93 ms, fast) and within 2 %
    of 1 stage from 8K to 75600 (best gain 1.9 %, S=32K, fast transport) — inside the run-to-run spread, so
    no rule on S is supported by these numbers. Where pipelining pays, the measured choice finds it."""
    del mode, world_size, q, transport
    return 1
