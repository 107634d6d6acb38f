"""The rules of a call's plan, each written once and each returning its reason with its value: the mode
(:func:`mode_rule`), FP8's mode rule (:func:`fp8_mode`), the stage count (:func:`chunks_rule`), a 2-D mesh's
(:func:`mesh_rule`). The cross-node split is :mod:`cp_ops.plan.split`; the opt-in measured choice
:mod:`cp_ops.plan.measured`. A plan records the reasons its rules gave; :func:`cp_ops.describe` reports them.

``cp_ops.attention(..., chunks=c)``: ``c = 1`` runs the mode as transport-then-attend (bitwise equal to one device);
``c ≥ 2`` runs the mode's pipelined variant in c stages (:mod:`cp_ops.modes.agkv_pipelined`,
:mod:`cp_ops.modes.ulysses`); ``c = None`` is :func:`chunks_rule` by default, measured on first use by
:mod:`cp_ops.plan.measured` where measuring is asked for (``CP_OPS_TUNE_MODES=1``).
"""

from __future__ import annotations

from .. import modes, validate


def check_chunks(chunks) -> None:
    """``chunks`` must be None or an int ≥ 1 (ValueError naming the value)."""
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        auto = isinstance(chunks, str) and chunks.lower() == "auto"
        hint = " (None is what `cp-ops run --chunks auto` passes)" if auto else ""
        raise ValueError("chunks must be None (the default: the heuristic, chunks_rule; measured on first use where "
                         "CP_OPS_TUNE_MODES=1) or an int >= 1 (1 = transport-then-attend); got "
                         f"{chunks!r}{hint}")


def check_heads(mode: str, heads: int, world_size: int) -> None:
    """Raise ValueError if ``mode`` splits heads over the ranks and W does not divide H
    (:func:`cp_ops.validate.check_heads_divisible`, the one message of the rule)."""
    if modes.spec(mode).needs_heads_divisible and heads % world_size:
        others = [m for m in modes.names(False) if not modes.spec(m).needs_heads_divisible]
        validate.check_heads_divisible(heads, world_size, mode, others[0] if others else None)


def choose_mode(mode: str, heads: int, world_size: int) -> str:
    """The concrete mode for ``mode=`` at ``heads`` H and CP world size W (:func:`mode_rule` without the reason)."""
    return mode_rule(mode, heads, world_size)[0]


def fp8_mode(mode: str, fmts, heads: int, world_size: int) -> tuple[str, str]:
    """FP8's mode rule: ``(mode to choose from, reason or '')``. ``mode='auto'`` with K and V in different formats
    (``fmts``, :mod:`cp_ops.comm_dtype`'s normal form; e.g. the documented ``{"q", "v", "o"}`` choice), which AGKV
    cannot carry (one gather moves both), → 'ulysses' where W divides H — on a group of one rank too (it moves
    nothing; with ``CP_OPS_EMULATE_COMM=1`` it emulates Ulysses); else ``mode`` unchanged (AGKV's format check then
    raises naming the rule)."""
    if mode == "auto" and type(fmts) is tuple and len(fmts) == 4 and fmts[1] != fmts[2] and heads % world_size == 0:
        return "ulysses", (f"auto: comm_dtype sends K and V in different formats, which AGKV cannot carry (one "
                           f"gather moves both), and W={world_size} divides H={heads} -> ulysses")
    return mode, ""


def mode_rule(mode: str, heads: int, world_size: int) -> tuple[str, str]:
    """``(concrete mode, reason)`` for ``mode=`` at H heads and W ranks.

    'auto' → 'agkv' at W = 2 or where W does not divide H; else 'ulysses'. Why: per rank Ulysses receives
    4(W−1)/W of one local tensor, AGKV 2(W−1): equal at W = 2, where Ulysses adds an exposed inverse all-to-all,
    and AGKV measured ahead at every S at W = 2 (bf16, H=40, D=128, chunks 1: 4K 1.23x vs 1.10x fast, 1.10x vs 0.88x
    torch; 8K 1.53x vs 1.48x fast, 1.40x vs 1.27x torch; ``benchmarks/results/cp2_attention/``); from W = 3 Ulysses
    moves less. A named mode is checked (ValueError: unknown, 2-D on a 1-D group, H % W != 0) and returned.
    """
    if mode == "auto":
        if world_size > 2 and heads % world_size == 0 and "ulysses" in modes.names(False):
            return "ulysses", (f"auto: W={world_size} > 2 and W divides H={heads} -> ulysses (moves less than AGKV "
                               "from W = 3)")
        if world_size == 2:
            return "agkv", ("auto: W=2 -> agkv (both modes receive the same bytes; Ulysses adds an exposed inverse "
                            "all-to-all)")
        if heads % world_size:
            return "agkv", f"auto: W={world_size} does not divide H={heads} -> agkv"
        return "agkv", "auto -> agkv"
    if modes.spec(mode).dims != 1:
        raise ValueError(f"mode={mode!r} runs on a 2-D DeviceMesh (mesh_dim_names ('agkv', 'ulysses')); got a 1-D CP "
                         f"group of {world_size} ranks: pass group=mesh, or one of {modes.names()}")
    check_heads(mode, heads, world_size)
    return mode, f"mode {mode!r} given"


#: The heuristic's stage counts, keyed by (mode, transport as run: 'fast' or 'torch', never 'auto'); a key not listed
#: gets 1. Source and numbers: :func:`chunks_rule`.
HEURISTIC_CHUNKS: dict[tuple[str, str], int] = {
    ("agkv", "fast"): 2,
}


def chunks_rule(mode: str, world_size: int, transport: str, given: int | None = None,
                layout_call: bool = False) -> tuple[int, str]:
    """``(stage count, reason)`` for ``chunks=given`` where the choice is not measured (:mod:`cp_ops.plan.measured`
    says when; also the candidate its pick prefers within the margin): ``given`` when not None; 1 where W = 1 or for
    a ``layout_call`` (uneven shards or a key mask); else :data:`HEURISTIC_CHUNKS` ``[(mode, transport)]``, 1 for a
    pair not listed. ``transport``: the one the call runs on, 'fast' or 'torch' (ValueError for 'auto': resolve it
    with :func:`cp_ops.transport.base.concrete_name`).

    Source (``benchmarks/results/cp2_attention/``): CP2, bf16, B=1, H=40, D=128, steady-state speedup over one GPU,
    eager, fast transport, AGKV, chunks=2 vs chunks=1 in interleaved rounds: 4096: 1.20x vs 1.23x (host-bound; from a
    CUDA graph 1.66x vs 1.31x); 8192: 1.76x vs 1.53x; 16384: 1.86x vs 1.76x; 32768: 1.92x vs 1.89x; 75600: 1.94x vs
    1.93x. Torch transport: within a few % either way (kept at 1). Ulysses head sub-groups were slower than one group
    at every S on both transports. Measured at W = 2; used for every W.
    """
    if given is not None:
        return given, f"chunks={given} given"
    if layout_call:
        return 1, "uneven shards or a key mask: chunks=None means 1 (transport-then-attend)"
    if transport == "auto":
        raise ValueError("chunks_rule needs the transport the call runs on ('fast' or 'torch'), got 'auto': resolve "
                         "it with cp_ops.transport.base.concrete_name")
    if world_size <= 1:
        return 1, "a group of one rank: nothing to pipeline"
    n = HEURISTIC_CHUNKS.get((mode, transport), 1)
    return n, (f"chunks=None -> {n} (2 stages for AGKV on the fast transport, 1 elsewhere; transport {transport})")


def mesh_rule(shape: tuple[int, int], mode: str, chunks: int | None) -> tuple[tuple | None, int, str]:
    """A call on an ``(O, I)`` ('agkv', 'ulysses') mesh: ``(degenerate, chunks, reason)``. ``degenerate``: for a mesh
    with one non-trivial dim, ``(dim name, 1-D mode)`` to run on that dim's group instead (``1×I`` → Ulysses over the
    inner group, ``O×1`` → AGKV over the outer group: the same call, so equal to it bitwise), else None (``1×1``:
    local attention; else the 2-D mode). ``chunks``: None → 1 (k ≥ 2 pipelines the outer AGKV)."""
    o, i = shape
    if o == 1 and i > 1 or i == 1 and o > 1:
        dim = "ulysses" if o == 1 else "agkv"
        return (dim, dim), 1 if chunks is None else chunks, (
            f"a {o}x{i} mesh: 1-D {dim} over its '{dim}' dim" + ("" if mode == "auto" else f" (mode {mode!r} given)"))
    if o * i == 1:
        return None, 1, "a 1x1 mesh: local attention, nothing moved"
    return None, 1 if chunks is None else chunks, (
        f"a {o}x{i} mesh: Ulysses over the inner dim ({i} ranks), AGKV over the outer dim ({o} rows)"
        + ("" if chunks is not None else ", chunks=None means 1"))


def outer_transport(transport: str) -> str:
    """The transport of a 2-D call's outer (AGKV) dim: 'torch' when the caller asked for it, else 'auto' (fast only
    where the outer group can host it: one node)."""
    return "torch" if transport == "torch" else "auto"
