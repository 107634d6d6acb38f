"""Which pipelined variant each mode has, and how many stages (``chunks``) a call uses.

``cp_ops.attention(..., chunks=c)``: ``c = 1`` runs the mode as transport-then-attend (bitwise equal to one
device); ``c ≥ 2`` runs the mode's pipelined variant in c stages (:mod:`.agkv_pipelined`,
:mod:`.ulysses`); ``c = None`` is the heuristic :func:`choose_chunks` by default, measured on first use by
:mod:`.tune` where measuring is asked for (``CP_OPS_TUNE_MODES=1``).
"""

from __future__ import annotations

import torch


def check_chunks(chunks) -> None:
    """``chunks`` must be None or an int ≥ 1 (ValueError naming the value)."""
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        auto = isinstance(chunks, str) and chunks.lower() == "auto"
        hint = " (None is what `cp-ops run --chunks auto` passes)" if auto else ""
        raise ValueError("chunks must be None (the default: the heuristic, choose_chunks; measured on first use where "
                         "CP_OPS_TUNE_MODES=1) or an int >= 1 (1 = transport-then-attend); got "
                         f"{chunks!r}{hint}")


#: The heuristic's stage counts, keyed by (mode, transport as run: 'fast' or 'torch', never 'auto'); a key not listed
#: gets 1. Source and numbers: :func:`choose_chunks`.
HEURISTIC_CHUNKS: dict[tuple[str, str], int] = {
    ("agkv", "fast"): 2,
}


def choose_chunks(mode: str, world_size: int, q: torch.Tensor, transport: str) -> int:
    """The heuristic stage count for ``chunks=None`` where the choice is not measured: measuring off
    (``CP_OPS_TUNE_MODES=0``), code traced by ``torch.compile``, a first call inside CUDA-graph capture (see
    :mod:`.tune`); also the candidate :func:`.tune.pick` prefers among the measured ones within its margin.

    Args:
        mode: the concrete mode ('agkv', 'ulysses', ...). world_size: W. q: ``[B, S_local, H, D]`` (unused: the rule
            does not depend on the shape). transport: the transport the call runs on, 'fast' or 'torch' (what
            :func:`cp_ops.transport.base.concrete_name` gives; never 'auto').
    Returns:
        1 where W = 1 (nothing to pipeline); else :data:`HEURISTIC_CHUNKS` ``[(mode, transport)]``, 1 for a pair not
        listed: 2 for AGKV on the fast transport, 1 (transport-then-attend, bitwise equal to one device) otherwise.
    Raises:
        ValueError: transport is 'auto' (a caller must resolve it first: the rule depends on the transport run).

    Source: CP2 on 2x H200, bf16, B=1, H=40, D=128, steady-state speedup over one GPU, eager
    (benchmarks/results/2026-11-30c_h200x2_torch2.11_cu130/README.md). Fast transport, AGKV, chunks=2 vs chunks=1:
    4096: 1.36x vs 1.23x; 8192: 1.71x vs 1.59x; 16384: 1.80x vs 1.75x; 32768: 1.93x vs 1.86x; 75600: 1.96x vs
    1.95x — 2 stages ahead at every S. Re-measured in interleaved rounds (2026-11-30d, same shapes): 4096: 1.20x vs
    1.23x (eager at 4K is host-bound; from a CUDA graph 1.66x vs 1.31x); 8192: 1.76x vs 1.53x; 16384: 1.86x vs
    1.76x; 32768: 1.92x vs 1.89x; 75600: 1.94x vs 1.93x. Torch transport: chunks=2 within ±2 % of chunks=1 (no
    gain) in 2026-11-30c; in 2026-11-30d mixed: 4096 0.90x vs 1.10x, 8192 1.40x vs 1.40x, 16384 1.70x vs 1.68x,
    32768 1.82x vs 1.72x, 75600 1.91x vs 1.91x (kept at 1). Ulysses head sub-groups were slower than one group at
    every S on both transports (2026-11-29, pipelined_gloo_check_0019c2b.md). Not measured at W > 2: the table
    holds for W = 2 and is used for every W.
    """
    del q
    if transport == "auto":
        raise ValueError("choose_chunks needs the transport the call runs on ('fast' or 'torch'), got 'auto': resolve "
                         "it with cp_ops.transport.base.concrete_name")
    if world_size <= 1:
        return 1
    return HEURISTIC_CHUNKS.get((mode, transport), 1)
