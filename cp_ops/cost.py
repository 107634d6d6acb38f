"""A cost model of one CP attention step: bytes per link and a predicted time for every layout of W = nodes × G ranks.

Pure arithmetic: :func:`predict` lists every 2-D split ``(O, I)`` whose inner (Ulysses) groups lie inside a node or
are whole nodes and whose I divides the heads (pure AGKV ``W×1`` and pure Ulysses ``1×W`` included), plus ring;
:func:`choose` picks the fastest one cp_ops runs. Bytes per rank per call, with ``L = B·(S/W)·H·D·bytes`` and m of
a group's n ranks on this rank's node: Ulysses ``4·L·(n−1)/n``, ``4·L·(m−1)/n`` of it over NVLink; AGKV (and ring)
``2·L·(n−1)``, ``2·L·(m−1)`` over NVLink (2-D: n = O, the row's K/V for H/I heads also ``L`` each). The time rule
and the figures (:class:`Links`): ``docs/2d.md``; ``overlapped_ms`` hides AGKV under attention, ring is
``max(attention, AGKV) + one latency``.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4, "fp8": 1}


@dataclass(frozen=True)
class Links:
    """Link and compute figures (see the module docstring for their sources)."""

    nvlink_gbps: float = 345.0  #: GB/s per rank inside a node (measured: benchmarks/results/transfer/)
    network_gbps: float = 50.0  #: GB/s per rank across nodes (assumed: 400 Gb/s per GPU)
    nvlink_latency_ms: float = 0.02  #: per collective inside a node (assumed)
    network_latency_ms: float = 0.03  #: per collective spanning nodes (assumed)
    attn_tflops: float = 550.0  #: attention throughput per GPU, TFLOP/s (measured low end, bf16 cuDNN)


def links() -> Links:
    """The figures cp_ops decides with: :class:`Links`' defaults, the network bandwidth from ``CP_OPS_NETWORK_GBPS``."""
    from . import config

    return Links(network_gbps=config.settings.network_gbps)


@dataclass(frozen=True)
class Prediction:
    """One layout's prediction. ``layout``: 'agkv_ulysses' (2-D; pure AGKV is ``outer=W, inner=1``, pure Ulysses
    ``outer=1, inner=W``) or 'ring'. Bytes are per rank per call (MB = 1e6 bytes), times in ms."""

    layout: str
    outer: int
    inner: int
    nvlink_mb: float
    network_mb: float
    comm_ms: float
    attn_ms: float
    time_ms: float
    overlapped_ms: float
    speedup: float
    overlapped_speedup: float

    @property
    def name(self) -> str:
        if self.layout == "ring":
            return "ring"
        if self.inner == 1:
            return "agkv"
        if self.outer == 1:
            return "ulysses"
        return f"{self.outer}x{self.inner}"


def _sharing(n: int, stride: int, ranks_per_node: int) -> int:
    """How many ranks of a group of ``n`` (ranks ``stride`` apart in node-major order) share a node with one of them."""
    if stride >= ranks_per_node:
        return 1
    return min(n, ranks_per_node // stride)


def _coll(nv_bytes: float, net_bytes: float, links: Links) -> float:
    if nv_bytes == 0 and net_bytes == 0:
        return 0.0
    lat = links.network_latency_ms if net_bytes else links.nvlink_latency_ms
    return lat + max(nv_bytes / (links.nvlink_gbps * 1e6), net_bytes / (links.network_gbps * 1e6))


def splits(world: int, ranks_per_node: int, heads: int) -> list[tuple[int, int]]:
    """The ``(O, I)`` 2-D splits of ``world`` the model considers: I divides the heads and either divides
    ``ranks_per_node`` (inner groups inside a node) or is a multiple of it (inner groups of whole nodes)."""
    out = []
    for i in range(1, world + 1):
        if world % i or heads % i:
            continue
        if ranks_per_node % i == 0 or i % ranks_per_node == 0:
            out.append((world // i, i))
    return out


def predict(tokens: int, heads: int, head_dim: int, *, ranks_per_node: int, nodes: int = 1, dtype: str = "bf16",
            batch: int = 1, links: Links = Links(), attn_ms: float | None = None) -> list[Prediction]:
    """Every layout's :class:`Prediction` for dense attention over ``tokens`` tokens on ``nodes`` ×
    ``ranks_per_node`` ranks (node-major), fastest first. ``attn_ms``: the measured attention time of one rank's
    share in ms (None: from ``links.attn_tflops``). ValueError: a count < 1; a dtype not in :data:`DTYPE_BYTES`."""
    if min(tokens, heads, head_dim, ranks_per_node, nodes, batch) < 1:
        raise ValueError(f"predict: tokens, heads, head_dim, ranks_per_node, nodes and batch must be >= 1; got "
                         f"{tokens}, {heads}, {head_dim}, {ranks_per_node}, {nodes}, {batch}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"predict: dtype must be one of {sorted(DTYPE_BYTES)}; got {dtype!r}")
    w, g = nodes * ranks_per_node, ranks_per_node
    local = batch * tokens / w * heads * head_dim * DTYPE_BYTES[dtype]  # L, bytes
    if attn_ms is None:
        attn_ms = 4.0 * batch * (tokens / w) * tokens * heads * head_dim / (links.attn_tflops * 1e12) * 1e3
    one_gpu = attn_ms * w
    out = []
    for o, i in splits(w, g, heads):
        m_in = _sharing(i, 1, g)
        m_out = _sharing(o, i, g)
        u_nv, u_net = 4 * local * (m_in - 1) / i, 4 * local * (i - m_in) / i  # Ulysses, both directions
        a_nv, a_net = 2 * local * (m_out - 1), 2 * local * (o - m_out)  # AGKV over the outer group
        u_ms = _coll(0.75 * u_nv, 0.75 * u_net, links) + _coll(0.25 * u_nv, 0.25 * u_net, links)
        a_ms = _coll(a_nv, a_net, links)
        t = u_ms + a_ms + attn_ms
        t_over = u_ms + max(a_ms, attn_ms)
        out.append(Prediction("agkv_ulysses", o, i, (u_nv + a_nv) / 1e6, (u_net + a_net) / 1e6, u_ms + a_ms, attn_ms,
                              t, t_over, one_gpu / t, one_gpu / t_over))
    # ring over all W: the AGKV bytes, one peer block per step under the attention of the block before
    r_nv, r_net = 2 * local * (min(w, g) - 1), 2 * local * (w - min(w, g))
    step = (links.network_latency_ms if nodes > 1 else links.nvlink_latency_ms) if w > 1 else 0.0
    r_comm = max(r_nv / (links.nvlink_gbps * 1e6), r_net / (links.network_gbps * 1e6))
    t_ring = max(attn_ms, r_comm) + step
    out.append(Prediction("ring", 1, w, r_nv / 1e6, r_net / 1e6, r_comm + step, attn_ms, t_ring, t_ring,
                          one_gpu / t_ring, one_gpu / t_ring))
    return sorted(out, key=lambda p: p.time_ms)


def choose(tokens: int, heads: int, head_dim: int, *, ranks_per_node: int, nodes: int = 1, dtype: str = "bf16",
           batch: int = 1, links: Links = Links(), attn_ms: float | None = None, overlapped: bool = False) -> Prediction:
    """The fastest layout cp_ops runs (2-D splits, pure AGKV and pure Ulysses; ring is predicted, not run) by
    transport-then-attend time (``overlapped=True``: by the overlapped time, for ``chunks ≥ 2``). Ties go to the larger
    inner size (less network traffic). Arguments and errors as :func:`predict`."""
    preds = [p for p in predict(tokens, heads, head_dim, ranks_per_node=ranks_per_node, nodes=nodes, dtype=dtype,
                                batch=batch, links=links, attn_ms=attn_ms) if p.layout != "ring"]
    key = (lambda p: (round(p.overlapped_ms if overlapped else p.time_ms, 9), -p.inner))
    return min(preds, key=key)


def table(preds: list[Prediction], links: "Links | None" = None) -> str:
    """A markdown table of predictions, titled with the link figures they assume (ring: for comparison only)."""
    links = links or Links()
    rows = [f"predicted for these links (NVLink {links.nvlink_gbps:g} GB/s per rank measured; network "
            f"{links.network_gbps:g} GB/s per GPU assumed); ring: for comparison, not run by cp_ops",
            "| layout | NVLink MB | network MB | comm ms | attention ms | time ms | speedup | overlapped speedup |",
            "|---|---|---|---|---|---|---|---|"]
    for p in preds:
        rows.append(f"| {p.name} | {p.nvlink_mb:.1f} | {p.network_mb:.1f} | {p.comm_ms:.3f} | {p.attn_ms:.3f} | "
                    f"{p.time_ms:.3f} | {p.speedup:.2f}x | {p.overlapped_speedup:.2f}x |")
    return "\n".join(rows)
