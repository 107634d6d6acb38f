"""``mode='auto'`` on a flat CP group whose ranks span several nodes: the cost model picks the split (docs/2d.md,
"``mode="auto"`` on a flat group across nodes"): ``W×1`` pure AGKV, ``1×W`` pure Ulysses (both over the flat
group), or ``O×I`` 2-D CP on a mesh built from the group (group rank r = mesh rank r), once per (group, O, I, device).

**Every rank meets at the same keys.** Every call's plan on a group across nodes meets the split's agreement (one
store exchange, :func:`decide`); ranks whose values differ all take the 1-D path, whose rank contract raises on every
rank. A rank whose call differs from one its peers already cached meets no agreement: raised at ``CP_OPS_TIMEOUT_S``.
"""

from __future__ import annotations

import datetime
import operator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .. import comm_dtype as cd
from .. import config, contract, cost, node
from .. import mesh as meshes
from . import rules

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class Split(NamedTuple):
    """What ``mode='auto'`` runs for one call shape on a flat group: ``mode`` 'agkv', 'ulysses' (1-D) or
    'agkv_ulysses' (2-D on ``outer × inner``); ``source`` 'cost', 'heuristic' (the node layout allows no split) or
    'mismatch' (the ranks' calls differ: the 1-D path, whose checks raise); ``why`` with the predicted ms."""

    mode: str
    outer: int
    inner: int
    source: str
    why: str

    @property
    def shape(self) -> str:
        return f"{self.outer}x{self.inner}"


_meshes: dict = {}  # (group name, O, I, device type) -> (DeviceMesh, its row group, its column group)


def _request(q, seq_lens, chunks):
    """The cost-model request of a call (``(tokens, heads, head_dim, batch, dtype, overlapped)``), or None when q is
    not a 4-D tensor of a supported dtype (the plan's checks raise)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in _DTYPES:
        return None
    b, s, h, d = (operator.index(x) for x in q.shape)  # under torch.compile: specializes symbolic sizes (guards)
    return b, s, h, d, _DTYPES[q.dtype], chunks is not None and type(chunks) is int and chunks > 1


def choose(ids, b: int, s: int, h: int, d: int, dtype: str = "bf16", overlapped: bool = False,
           seq_lens=None) -> Split | None:
    """The split of a call on a flat group whose ranks have node identities ``ids`` (group-rank order), per-rank q
    ``[b, s, h, d]`` (``seq_lens``: uneven), ``overlapped``: ``chunks ≥ 2``. None: one node. Pure: no collective."""
    w, seq = len(ids), seq_lens
    n_nodes = len(set(ids))
    if n_nodes == 1:
        return None
    heur = rules.mode_rule("auto", h, w)[0] if h >= 1 else "agkv"

    def heuristic(why: str) -> Split:
        return Split(heur, w if heur == "agkv" else 1, 1 if heur == "agkv" else w, "heuristic",
                     f"mode='auto' on a flat group across {why}: no 2-D split; the 1-D heuristic: {heur}")

    try:
        nodes, per = node.layout(ids)
    except ValueError as e:
        return heuristic(f"{n_nodes} nodes ({e})")
    if not node.node_major(ids):
        return heuristic(f"{nodes} nodes whose ranks are not numbered node by node (node ids by group rank: "
                         f"{list(ids)})")
    tokens = sum(seq) if seq is not None else s * w
    links = cost.links()  # CP_OPS_NETWORK_GBPS: equal on every rank
    preds = [p for p in cost.predict(max(tokens, 1), h, d, ranks_per_node=per, nodes=nodes, dtype=dtype, batch=b,
                                     links=links) if p.layout != "ring"]
    best = cost.choose(max(tokens, 1), h, d, ranks_per_node=per, nodes=nodes, dtype=dtype, batch=b, links=links,
                       overlapped=overlapped)
    mode = "agkv" if best.inner == 1 else "ulysses" if best.outer == 1 else "agkv_ulysses"
    key = (lambda p: p.overlapped_ms) if overlapped else (lambda p: p.time_ms)
    listed = ", ".join(f"{p.name} {key(p):.3f}" for p in sorted(preds, key=key))
    what = "overlapped (chunks >= 2)" if overlapped else "transport-then-attend"
    why = (f"mode='auto' on a flat group across {nodes} nodes x {per} ranks: the cost model (cp_ops.cost; NVLink "
           f"{links.nvlink_gbps:g} GB/s measured, network {links.network_gbps:g} GB/s per GPU assumed: "
           f"CP_OPS_NETWORK_GBPS) "
           f"predicts per call, {what} ms, for {tokens} tokens x {h} heads x {d} ({dtype}, B={b}): {listed} -> "
           f"{best.name}" + (f" (mesh {best.outer}x{best.inner}: Ulysses over {best.inner} ranks inside a row, AGKV "
                              f"over {best.outer} rows)" if mode == "agkv_ulysses" else ""))
    return Split(mode, best.outer, best.inner, "cost", why)


def decide(group_name: str, shape: tuple | None, dtype: str, chunks_gt1: bool, seq, device_type: str,
           skip: str = "") -> tuple | None:
    """The split of a call (:class:`Split`'s fields), agreed by the group's ranks; None: the 1-D path (one node, or
    this rank takes none: ``skip`` says why, ``shape`` None for invalid inputs). Constant for ``torch.compile``."""
    pg = _resolve_process_group(group_name)
    ids = node.group_nodes(pg)
    if len(set(ids)) == 1:
        return None
    got, mine = None, skip or "invalid inputs"
    if shape is not None and not skip:
        b, s, h, d = shape
        got = choose(ids, b, s, h, d, dtype, chunks_gt1, seq)
        mine = f"{b}x{s}x{h}x{d} {dtype} pipelined={int(chunks_gt1)} seq_lens={seq} -> {got.mode} {got.shape}"
    seen = contract.agree(pg, "split", mine, "mode='auto''s split (cp_ops.plan.split)")
    if len(set(seen)) != 1:  # the ranks' calls differ: the 1-D path, whose checks name the difference (not kept)
        diff = [f"rank {r}: {v}" for r, v in enumerate(seen) if v != mine]
        return tuple(Split("", 0, 0, "mismatch",
                           f"mode='auto' on a flat group across nodes: the ranks' calls differ (this rank: {mine}; "
                           f"{'; '.join(diff[:4])}): the 1-D path, whose checks name the difference"))
    if got is None:
        return None
    if got.mode == "agkv_ulysses":
        _mesh(pg, got.outer, got.inner, device_type)
    return tuple(got)


decide._dynamo_marked_constant = True  # type: ignore[attr-defined] - torch.compiler.assume_constant_result


def spans_nodes(group_name: str) -> bool:
    """Whether the group's ranks are on more than one node (collective on the group's first call:
    :func:`cp_ops.node.group_nodes`). Marked constant for ``torch.compile``, as :func:`decide`."""
    return len(set(node.group_nodes(_resolve_process_group(group_name)))) > 1


spans_nodes._dynamo_marked_constant = True  # type: ignore[attr-defined] - torch.compiler.assume_constant_result


def _mesh(pg: dist.ProcessGroup, outer: int, inner: int, device_type: str):
    """``pg``'s ``('agkv', 'ulysses')`` mesh, ``outer × inner`` (rank r = mesh rank r); built once, freed with pg."""
    key = (pg.group_name, outer, inner, device_type)
    got = _meshes.get(key)
    if got is not None:
        return got[0]
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(pg)
    grid = [ranks[o * inner:(o + 1) * inner] for o in range(outer)]
    o, i = divmod(pg.rank(), inner)
    timeout = datetime.timedelta(seconds=config.settings.timeout_s)
    row = dist.new_group(grid[o], timeout=timeout, use_local_synchronization=True)
    col = dist.new_group([grid[x][i] for x in range(outer)], timeout=timeout, use_local_synchronization=True)
    mesh = DeviceMesh.from_group([col, row], device_type, mesh=grid, mesh_dim_names=meshes.DIM_NAMES)
    _meshes[key] = (mesh, row, col)
    return mesh


def mesh_of(group_name: str, outer: int, inner: int, device_type: str):
    """The mesh :func:`decide` built for a 2-D split, or None before it did."""
    return _meshes.get((group_name, outer, inner, device_type), (None,))[0]


def local_mask(call, pg):
    """The key mask a call on the split's mesh takes: a ``[B, S_total]`` mask becomes this rank's ``[B, S_local]``
    slice; any other as given (the mesh's checks judge it)."""
    m, q = call.key_mask, call.q
    if not isinstance(m, torch.Tensor) or m.dim() != 2 or not isinstance(q, torch.Tensor) or q.dim() != 4:
        return m
    s, w, r = q.shape[1], pg.size(), pg.rank()
    seq = _seq(call.seq_lens, w)
    total = sum(seq) if seq is not None else s * w
    if m.shape[1] != total or total == s:
        return m
    lo = sum(seq[:r]) if seq is not None else r * s
    return m[:, lo:lo + s]


def _skip(call) -> str:
    """Why a flat-group call takes no split ('' where it may: ``mode='auto'`` with nothing in FP8; ``comm_dtype`` is
    in its normal form, so ``q.dtype`` and None are one)."""
    if call.mode != "auto":
        return f"no split: mode={call.mode!r} given"
    if call.comm_dtype != cd.NONE:
        return "no split: comm_dtype moves FP8 (the cost model prices the input dtype's bytes)"
    return ""


def route(call, pg: dist.ProcessGroup) -> Split | None:
    """The split a call on the flat group ``pg`` runs: source 'cost', 'mismatch' (the ranks' calls differ: the 1-D
    path, the plan not kept), or None (the 1-D path). Every call's plan on a group across nodes asks."""
    if pg.size() == 1:
        return None
    if torch.compiler.is_compiling():
        if not spans_nodes(pg.group_name):
            return None
    elif len(set(node.group_nodes(pg))) == 1:
        return None
    skip, q = _skip(call), call.q
    req = None if skip else _request(q, call.seq_lens, call.chunks)
    if req is None:
        got = decide(pg.group_name, None, "", False, None, "cpu", skip)
    else:
        b, s, h, d, dtype, piped = req
        got = decide(pg.group_name, (b, s, h, d), dtype, piped, _seq(call.seq_lens, pg.size()), q.device.type)
    out = None if got is None else Split(*got)
    return out if out is not None and out.source in ("cost", "mismatch") else None


def _seq(seq_lens, w: int):
    """``seq_lens`` as a tuple of W ints, or None (even shards; a bad one: None, the checks raise)."""
    if seq_lens is None:
        return None
    try:
        seq = tuple(int(x) for x in seq_lens)
    except (TypeError, ValueError):
        return None
    return seq if len(seq) == w and min(seq, default=0) >= 0 else None


def known(call, pg: dist.ProcessGroup) -> Split | None:
    """What :func:`route` gives for this call without a collective (a 'heuristic' split too, for its reason), or None
    (one node, no split taken, bad inputs, or the node layout not known before the group's first call)."""
    req = None if _skip(call) else _request(call.q, call.seq_lens, call.chunks)
    if req is None or pg.size() == 1:
        return None
    ids = node.known_nodes(pg)
    if ids is None or len(set(ids)) == 1:
        return None
    b, s, h, d, dtype, piped = req
    return choose(ids, b, s, h, d, dtype, piped, _seq(call.seq_lens, pg.size()))


def _release(key) -> None:
    mesh, row, col = _meshes.pop(key)
    for g in (row, col):
        try:
            dist.destroy_process_group(g)
        except (ValueError, RuntimeError, AssertionError):  # already destroyed (or the default group is gone)
            pass


def release(pg: Any) -> None:
    """Destroy the meshes built from the flat group ``pg`` (:mod:`cp_ops.plan`, once it notices ``pg`` destroyed)."""
    for key in [k for k in _meshes if k[0] == getattr(pg, "group_name", None)]:
        _release(key)
