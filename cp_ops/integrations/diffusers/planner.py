"""The planned layout of a pipeline on N ranks: CFG lanes or not, the CP width and mode of each lane, and the step
time each layout is predicted to take (docs/pipelines.md, "The planned layout"). :func:`parallelize_pipeline` runs
the choice; ``cp-ops plan MODEL --gpus N`` prints it. Each lane's mode is predicted as ``mode='auto'`` runs it, not
decided here; rank 0's forward comes from :data:`BOUND` (measured), the link time from :func:`cp_ops.cost.predict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ... import cost, modes
from ...plan.rules import mode_rule
from .lanes import cfg_kind

#: The compile paths with measured rows (``parallelize``'s ``compile`` / ``cuda_graphs`` → :func:`path_for`).
PATHS = ("eager", "eager+graphs", "regional+capture")


@dataclass(frozen=True)
class Row:
    """One measured model: ``label``; ``match``: the config entries that identify it among its class's rows;
    ``tokens``: image/video tokens it was measured at; ``heads``, ``head_dim``; ``calls``: CP attention calls per
    forward; ``ms``: compile path → rank 0's forward in ms at W = 1, 2, 4, 8."""

    label: str
    match: Mapping
    tokens: int
    heads: int
    head_dim: int
    calls: int
    ms: Mapping[str, tuple[float, float, float, float]]


#: Rank 0's forward (ms) at W = 1/2/4/8, batch 1, bf16, one NVIDIA H200, torch 2.11 + CUDA 13.0, diffusers 0.42.1:
#: benchmarks/results/bound/bound.json (its cp_ops rows; W = 1: the one-GPU forward).
BOUND: dict[str, tuple[Row, ...]] = {
    "FluxTransformer2DModel": (Row("FLUX.1-dev 1024²", {"num_layers": 19}, 4096, 24, 128, 57, {
        "eager": (180.4, 97.3, 86.1, 85.3), "eager+graphs": (175.2, 90.7, 49.5, 30.7),
        "regional+capture": (133.4, 72.9, 38.7, 24.2)}),),
    "QwenImageTransformer2DModel": (Row("Qwen-Image 1328²", {"num_layers": 60}, 6889, 24, 128, 60, {
        "eager": (340.3, 198.9, 192.9, 180.7), "eager+graphs": (334.5, 178.8, 99.8, 66.2),
        "regional+capture": (260.2, 147.0, 79.7, 51.9)}),),
    "ZImageTransformer2DModel": (Row("Z-Image-Turbo 1024²", {"n_layers": 30}, 4096, 30, 128, 30, {
        "eager": (146.9, 83.2, 70.3, 72.6), "eager+graphs": (145.4, 73.5, 39.8, 23.7),
        "regional+capture": (98.2, 53.5, 27.5, 15.2)}),),
    "LTXVideoTransformer3DModel": (Row("LTX-Video 768x512x121", {"num_layers": 28}, 6144, 32, 64, 28, {
        "eager": (89.6, 48.6, 50.2, 51.4), "eager+graphs": (86.5, 42.2, 23.4, 14.9),
        "regional+capture": (59.2, 30.7, 16.6, 10.2)}),),
    "WanTransformer3DModel": (
        Row("Wan2.1-1.3B 480p", {"num_layers": 30}, 32760, 12, 128, 30, {
            "eager": (644.0, 321.1, 165.3, 84.5), "eager+graphs": (642.3, 313.2, 163.6, 79.8),
            "regional+capture": (525.3, 267.3, 134.6, 69.9)}),
        Row("Wan2.1-14B 480p", {"num_layers": 40}, 32760, 40, 128, 40, {
            "eager": (3370.1, 1661.3, 866.8, 440.1), "eager+graphs": (3361.3, 1678.1, 855.1, 431.3),
            "regional+capture": (2836.3, 1441.3, 739.8, 366.6)})),
    "HunyuanVideoTransformer3DModel": (Row("HunyuanVideo 544x960x61", {"num_layers": 20}, 32640, 24, 128, 60, {
        "eager": (3195.3, 1582.7, 818.8, 419.1), "eager+graphs": (3185.5, 1588.0, 803.6, 406.7),
        "regional+capture": (2698.1, 1356.1, 689.8, 348.3)}),),
}
_WIDTHS = (1, 2, 4, 8)


def path_for(compile: bool, cuda_graphs, cuda: bool) -> str:  # noqa: A002 - parallelize's argument name
    """The :data:`PATHS` entry that ``parallelize(compile=, cuda_graphs=)`` runs on CUDA (``cuda``) or the CPU."""
    graphs = cuda and cuda_graphs is not False
    return "regional+capture" if compile and graphs else "eager+graphs" if graphs else "eager"


def row_for(cls: str, config: Mapping | None) -> tuple[Row | None, str]:
    """The :data:`BOUND` row for a transformer class and config, and how it was found ('' = matched its config)."""
    rows = BOUND.get(cls)
    if not rows:
        return None, f"{cls} has no measured row"
    if config is None and len(rows) == 1:
        return rows[0], ""
    for r in rows:
        if config is not None and all(config.get(k) == v for k, v in r.match.items()):
            return r, ""
    return rows[0], f"no row for this {cls} config: {rows[0].label}'s scaling stands in"


@dataclass(frozen=True)
class Layout:
    """One candidate: ``lanes`` (1 or 2) × CP ``cp`` ranks running ``mode``, ``forwards`` per step on a lane,
    ``forward_ms`` and ``comm_ms`` per forward (None for a row-less class)."""

    lanes: int
    cp: int
    mode: str
    forwards: int
    forward_ms: float | None = None
    comm_ms: float | None = None

    @property
    def step_ms(self) -> float | None:
        return None if self.forward_ms is None else self.forwards * (self.forward_ms + self.comm_ms)

    @property
    def name(self) -> str:
        return f"{self.lanes} lanes x CP{self.cp}" if self.lanes > 1 else f"CP{self.cp}"


@dataclass(frozen=True)
class Plan:
    """The chosen :class:`Layout` (``layout``), every candidate (``layouts``, the chosen first) and ``why``."""

    layout: Layout
    layouts: tuple[Layout, ...]
    why: str
    row: str = ""
    path: str = ""

    @property
    def cfg_parallel(self) -> bool:
        return self.layout.lanes == 2

    def __str__(self) -> str:
        lines = [f"planned layout: {self.layout.name} ({self.layout.mode}) - {self.why}"]
        if self.layout.step_ms is not None:
            lines.append(f"predicted per denoising step ({self.row}, {self.path}; H200 bound + link model):")
            for lay in self.layouts:
                lines.append(f"  {lay.name:<16} {lay.mode:<10} {lay.forwards} x ({lay.forward_ms:8.1f} ms forward + "
                             f"{lay.comm_ms:6.1f} ms comm) = {lay.step_ms:8.1f} ms"
                             + ("   <- chosen" if lay is self.layout else ""))
        return "\n".join(lines)


def _forward_ms(row: Row, path: str, n: int, tokens: int, links: cost.Links) -> float:
    """Rank 0's forward: the widest measured width w <= n scaled by w / n, then by the tokens r = tokens / measured
    as ``t · ((1 − a) · r + a · r²)``, ``a`` the attention's share of the one-GPU forward (its FLOP, at most 0.9)."""
    ms = dict(zip(_WIDTHS, row.ms[path]))
    w = max(x for x in _WIDTHS if x <= n)
    t = ms[w] * w / n
    r = tokens / row.tokens
    attn = 4.0 * row.tokens ** 2 * row.heads * row.head_dim * row.calls / (links.attn_tflops * 1e12) * 1e3
    a = min(0.9, attn / ms[1])
    return t * ((1 - a) * r + a * r * r)


def _heads(config: Mapping | None) -> int | None:
    if config is None:
        return None
    heads = config.get("num_attention_heads") or config.get("n_heads")
    return heads if isinstance(heads, int) and heads > 0 else None


def _nodes(n: int, ranks_per_node: int) -> tuple[int, int]:
    """``(ranks per node, nodes)`` of a lane of ``n`` ranks (node-major); a lane of part-nodes is priced as one node
    (:mod:`cp_ops.plan.split` does not split it either)."""
    g = min(n, ranks_per_node)
    return (g, n // g) if n % g == 0 else (n, 1)


def _mode(heads: int, n: int, ranks_per_node: int) -> str:
    if _nodes(n, ranks_per_node)[1] == 1:
        return mode_rule("auto", heads, n)[0]
    return "split"  # across nodes: plan/split.py's cost-model split


def _comm_ms(row: Row, n: int, mode: str, tokens: int, ranks_per_node: int, links: cost.Links) -> tuple[str, float]:
    """``(mode, link ms per forward)``; across nodes ``'split '`` + the split :mod:`cp_ops.plan.split` picks."""
    if n == 1:
        return mode, 0.0
    g, nodes = _nodes(n, ranks_per_node)
    if mode == "split":
        p = cost.choose(tokens, row.heads, row.head_dim, ranks_per_node=g, nodes=nodes, links=links)
        return f"split {p.name}", p.comm_ms * row.calls
    preds = cost.predict(tokens, row.heads, row.head_dim, ranks_per_node=g, nodes=nodes, links=links)
    # the row's heads may not split as the model's do: price the mode the row can run
    p = next((p for p in preds if p.name == mode), None) or next(p for p in preds if p.name == "agkv")
    return mode, p.comm_ms * row.calls


def plan(cls: str, n: int, *, cfg: str | None, config: Mapping | None = None, tokens: int | None = None,
         path: str = "eager+graphs", ranks_per_node: int | None = None, mode: str = "auto",
         lanes: int | None = None, links: cost.Links | None = None) -> Plan:
    """The layout for a transformer of class ``cls`` (``config`` picks among its class's rows) in a pipeline over
    ``n`` ranks. ``cfg``: 'paired' (one call per branch), 'batched' (a batch of 2) or None (no CFG: never lanes);
    ``tokens``: per forward (None: the measured one's); ``path``: one of :data:`PATHS`; ``ranks_per_node``: None =
    ``n``; ``mode``: the caller's (a head-splitting mode is not planned on a width that does not divide the heads);
    ``lanes``: the caller's choice (2 or 1), kept and predicted beside the plan's. ValueError: ``n`` < 1, an unknown
    ``cfg`` or ``path``."""
    if n < 1 or cfg not in (None, "paired", "batched") or path not in PATHS:
        raise ValueError(f"plan: n must be >= 1, cfg one of None/'paired'/'batched', path one of {PATHS}; got n={n}, "
                         f"cfg={cfg!r}, path={path!r}")
    if lanes == 2 and n % 2:  # parallelize refuses it (ValueError): say so instead of a layout of 2 x CP(n // 2)
        lay = Layout(1, n, mode, 2 if cfg else 1)
        return Plan(lay, (lay,), f"cfg_parallel=True given, which N={n} cannot run: two equal lanes need an even N "
                                 "(parallelize raises); pass cfg_parallel=False, or leave it out to have it planned")
    links = links or cost.links()
    rpn = min(n, ranks_per_node or n)
    two = cfg is not None and n % 2 == 0
    row, how = row_for(cls, config)
    if row is None:
        two = two if lanes is None else lanes == 2
        lay = Layout(2, n // 2, mode, 1) if two else Layout(1, n, mode, 2 if cfg else 1)
        rule = ("the pipeline runs CFG and N is even -> 2 lanes" if two else "no CFG -> no lanes" if cfg is None
                else f"N={n} is odd -> no lanes")
        why = f"cfg_parallel={two} given" if lanes is not None else f"{how}: the rule without numbers: {rule}"
        return Plan(lay, (lay,), why)
    s = tokens or row.tokens
    heads = _heads(config) or row.heads
    mode = mode if mode in modes.names(False) else "auto"  # another name: parallelize raises naming it
    cands = []
    for k in ((1, 2) if two or (lanes == 2 and n % 2 == 0) else (1,)):
        w = n // k
        if mode != "auto" and (modes.spec(mode).needs_heads_divisible and heads % w or modes.spec(mode).dims != 1):
            continue
        lane_mode = _mode(heads, w, rpn) if mode == "auto" else mode
        lane_mode, comm = _comm_ms(row, w, lane_mode, s, rpn, links)
        cands.append(Layout(k, w, lane_mode, 2 if cfg and k == 1 else 1, _forward_ms(row, path, w, s, links), comm))
    if not cands:  # parallelize raises naming the rule
        lay = Layout(lanes or 1, n // (lanes or 1), mode, 1)
        return Plan(lay, (lay,), f"mode {mode!r} runs on no lane width of N={n} (H={heads})")
    best = min(cands, key=lambda lay: (round(lay.step_ms, 6), lay.lanes))
    rest = [c for c in cands if c is not best]
    if lanes is not None and best.lanes != lanes:
        given = [c for c in cands if c.lanes == lanes]
        if given:
            best, rest = given[0], [c for c in cands if c is not given[0]]
    if lanes is not None:
        why = (f"cfg_parallel={lanes == 2} given"
               + (f"; the plan's {rest[0].name} predicted {rest[0].step_ms:.1f} ms per step vs {best.step_ms:.1f} ms"
                  if rest and rest[0].step_ms < best.step_ms else ""))
    elif cfg is None:
        why = "the pipeline runs no classifier-free guidance by default -> no lanes"
    elif not two:
        why = f"N={n} is odd -> no lanes"
    elif not rest:
        why = f"mode {mode!r} given: only {best.name} splits the {heads} heads"
    else:
        other = rest[0]
        why = (f"{best.name} predicted {best.step_ms:.1f} ms per step vs {other.name} {other.step_ms:.1f} ms "
               f"({other.step_ms / best.step_ms:.2f}x)")
    if how:
        why += f"; {how}"
    return Plan(best, (best, *rest), why, row.label + (f" at {s} tokens" if s != row.tokens else ""), path)


def plan_pipeline(pipe, model, n: int, *, ranks_per_node: int | None, cuda: bool, mode: str = "auto",
                  cfg_parallel: bool | None = None, compile: bool = False, cuda_graphs="auto") -> Plan:  # noqa: A002
    """:func:`plan` for ``model`` (a transformer of ``pipe``) over ``n`` ranks, the facts read from them."""
    config = dict(getattr(model, "config", None) or {})
    cfg = cfg_kind(type(pipe), getattr(pipe, "config", None))
    return plan(type(model).__name__, n, cfg=cfg, config=config, ranks_per_node=ranks_per_node,
                path=path_for(compile, cuda_graphs, cuda), mode=mode,
                lanes=None if cfg_parallel is None else 2 if cfg_parallel else 1)
