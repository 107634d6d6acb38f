"""The rules of a call's plan, each written once and returning its reason with its value: the mode
(:func:`mode_rule`), FP8's mode rule (:func:`fp8_mode`), the stage count (:func:`chunks_rule`), a 2-D mesh's
(:func:`mesh_rule`). A plan records the reasons; :func:`cp_ops.describe` reports them. ``chunks=1`` runs a mode
transport-then-attend (bitwise equal to one device), ``c ≥ 2`` its pipelined variant in c stages, ``None`` the rule
(measured on first use with ``CP_OPS_TUNE_MODES=1``: :mod:`cp_ops.plan.measured`).
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
    (``fmts``: :mod:`cp_ops.comm_dtype`'s normal form), which AGKV cannot carry, → 'ulysses' where W divides H (on one
    rank too); else ``mode`` unchanged (AGKV's format check then raises naming the rule)."""
    if mode == "auto" and type(fmts) is tuple and len(fmts) == 4 and fmts[1] != fmts[2] and heads % world_size == 0:
        return "ulysses", (f"auto: comm_dtype sends K and V in different formats, which AGKV cannot carry (one "
                           f"gather moves both), and W={world_size} divides H={heads} -> ulysses")
    return mode, ""


def mode_rule(mode: str, heads: int, world_size: int) -> tuple[str, str]:
    """``(concrete mode, reason)`` for ``mode=`` at H heads and W ranks: 'auto' → 'agkv' at W = 2 or where W does
    not divide H, else 'ulysses'. Why: per rank Ulysses receives 4(W−1)/W of one local tensor, AGKV 2(W−1): equal at
    W = 2, where Ulysses adds an exposed inverse all-to-all and AGKV measured ahead at every S
    (``benchmarks/results/cp2_attention/``). A named mode is checked (ValueError: unknown, 2-D, H % W != 0)."""
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
HEURISTIC_CHUNKS: dict[tuple[str, str], int] = {("agkv", "fast"): 2}


def chunks_rule(mode: str, world_size: int, transport: str, given: int | None = None,
                layout_call: bool = False) -> tuple[int, str]:
    """``(stage count, reason)`` for ``chunks=given`` where the choice is not measured (also the candidate the
    measured pick prefers): ``given`` when not None; 1 where W = 1 or for a ``layout_call`` (uneven shards or a key
    mask); else :data:`HEURISTIC_CHUNKS` ``[(mode, transport)]``, 1 for a pair not listed. ``transport``: 'fast' or
    'torch' (ValueError for 'auto'). Source: CP2 bf16 H=40 D=128, fast AGKV chunks=2 vs 1 over one GPU, 1.76x vs
    1.53x at 8K (``benchmarks/results/cp2_attention/``); torch transport and Ulysses sub-groups gained nothing."""
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
    """A call on an ``(O, I)`` mesh: ``(degenerate, chunks, reason)``. ``degenerate``: ``(dim name, 1-D mode)`` for a
    mesh with one non-trivial dim (``1×I`` → Ulysses, ``O×1`` → AGKV over that dim's group), else None.
    ``chunks``: None → 1."""
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
