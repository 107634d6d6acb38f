"""``mode='auto'`` on a flat CP group whose ranks span several nodes: the cost model picks the split.

A flat group (``None``, a ``ProcessGroup``, a 1-D mesh) whose ranks are on more than one node (:mod:`cp_ops.node`:
host names or ``CP_OPS_NODE_ID``) does not run the 1-D heuristic (:func:`cp_ops.modes.choose`): for each call shape
:func:`for_call` asks :func:`cp_ops.cost.choose` which split of W = nodes × G ranks is fastest and the call runs it:

* ``W×1`` → pure AGKV over the flat group (mode 'agkv');
* ``1×W`` → pure Ulysses over the flat group (mode 'ulysses'; W divides the heads);
* ``O×I`` otherwise → 2-D CP (mode 'agkv_ulysses', :mod:`cp_ops.dispatch_mesh`) on a mesh built from the flat group:
  row o = group ranks ``o·I .. o·I+I−1`` (the inner, Ulysses dim: one node's ranks, a part of one, or whole
  nodes), column i = the ranks of equal index in each row (the outer, AGKV dim). Group rank r is mesh rank r, so each
  rank keeps its token block (``seq_lens`` and key masks as given). Built once per (group, O, I, device type): two
  ``dist.new_group(..., use_local_synchronization=True)`` per rank (its row, then its column: only the member ranks
  meet), bounded by ``CP_OPS_TIMEOUT_S``.

**Inputs of the choice** (the same on every rank for the same call): the group's node layout (agreed once per group,
:func:`cp_ops.node.group_nodes`), the global token count (``S_local·W``, or ``sum(seq_lens)``), B, H, D, q's dtype
and whether the call pipelines (``chunks ≥ 2``: the overlapped time). The figures are :class:`cp_ops.cost.Links`'
defaults (H200 NVLink measured, the network assumed). No timing: deterministic. The first call of each shape agrees
the choice over the group (one store exchange, :func:`cp_ops.contract.agree`); ranks whose calls differ there (a rank
with a wrong shape) all take the 1-D path, whose checks then raise on every rank, naming the rule. A rank whose call
differs from a shape its peers have already agreed and kept (a later call) meets no agreement: that mismatch is
raised at ``CP_OPS_TIMEOUT_S`` (naming the ranks that did not arrive), not at once.

**Not used** (the 1-D heuristic decides, as on one node): a group on one node; nodes holding different rank counts or
ranks not numbered node by node (the split's rows would not be nodes; :attr:`Split.why` says so); ``comm_dtype``
given (the cost model prices the input dtype's bytes); an explicit ``mode``. Under ``torch.compile`` the choice is made while tracing
(:func:`decide`, a constant of the graph) and a 2-D split runs the traced 2-D path; the choice depends on the sizes,
so on several nodes a dynamic-shape compile specializes them (one graph per shape; on one node they stay dynamic).

:func:`cp_ops.describe` reports the split and the cost model's numbers (:attr:`Split.why`) once the group's node layout
is known (after its first ``mode='auto'`` call); before, it answers as for one node (it makes no collective).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import config, contract, cost, modes, node
from . import mesh as meshes

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class Split(NamedTuple):
    """What ``mode='auto'`` runs for one call shape on a flat group. ``mode``: 'agkv', 'ulysses' (1-D over the flat
    group) or 'agkv_ulysses' (2-D on ``outer × inner``); ``source``: 'cost' (the cost model chose), 'heuristic'
    (the 1-D heuristic: the node layout does not allow a split) or 'mismatch' (the ranks' calls differ: the 1-D path,
    whose checks raise; not kept); ``why``: the reason with
    the cost model's predicted ms per layout."""

    mode: str
    outer: int
    inner: int
    source: str
    why: str

    @property
    def shape(self) -> str:
        return f"{self.outer}x{self.inner}"


_calls: dict = {}  # (group, q shape, dtype, device type, seq_lens, pipelined) -> Split | None
_meshes: dict = {}  # (group name, O, I, device type) -> DeviceMesh
_one_node: set = set()  # groups of one rank or on one node: mode='auto' as the 1-D heuristic says


def _request(q, seq_lens, chunks):
    """The cost-model request of a call (``(tokens, heads, head_dim, batch, dtype, overlapped)``), or None when q is
    not a 4-D tensor of a supported dtype (the dispatcher's checks raise)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in _DTYPES:
        return None
    b, s, h, d = (operator.index(x) for x in q.shape)  # under torch.compile: specializes symbolic sizes (guards)
    return b, s, h, d, _DTYPES[q.dtype], chunks is not None and type(chunks) is int and chunks > 1


def choose(ids, b: int, s: int, h: int, d: int, dtype: str = "bf16", overlapped: bool = False,
           seq_lens=None) -> Split | None:
    """The split of a call on a flat group whose ranks have the node identities ``ids`` (group-rank order; W =
    ``len(ids)``), for q of shape ``[b, s, h, d]`` per rank (``seq_lens``: the W counts of uneven shards; tokens =
    their sum, else ``s·W``), ``dtype`` one of :data:`cp_ops.cost.DTYPE_BYTES`, ``overlapped``: the call pipelines
    (``chunks ≥ 2``). None: the ranks are on one node (the 1-D heuristic, silently). Pure: no collective."""
    w, seq = len(ids), seq_lens
    n_nodes = len(set(ids))
    if n_nodes == 1:
        return None
    heur = modes.choose("auto", h, w) if h >= 1 else "agkv"
    try:
        nodes, per = node.layout(ids)
    except ValueError as e:
        return Split(heur, w if heur == "agkv" else 1, 1 if heur == "agkv" else w, "heuristic",
                     f"mode='auto' on a flat group across {n_nodes} nodes: no 2-D split ({e}); the 1-D heuristic: "
                     f"{heur}")
    if not node.node_major(ids):
        return Split(heur, w if heur == "agkv" else 1, 1 if heur == "agkv" else w, "heuristic",
                     f"mode='auto' on a flat group across {nodes} nodes whose ranks are not numbered node by node "
                     f"(node ids by group rank: {list(ids)}): no 2-D split; the 1-D heuristic: {heur}")
    tokens = sum(seq) if seq is not None else s * w
    links = cost.Links(network_gbps=config.settings.network_gbps)  # CP_OPS_NETWORK_GBPS: equal on every rank
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


def decide(group_name: str, shape: tuple | None, dtype: str, chunks_gt1: bool, seq, device_type: str) -> tuple | None:
    """The split of a call (:class:`Split`'s fields), agreed by the group's ranks; None: the 1-D path as on one node
    (the group is on one node, or this rank's inputs are not a valid request: ``shape`` None). Collective on the
    first call of a group (node identities) and of each request (the agreement: every rank meets at one key, its
    request and split in the value, so ranks whose calls differ all fall back to the 1-D path instead of waiting).
    Marked constant for ``torch.compile`` (run while tracing; the graph holds its result)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    ids = node.group_nodes(pg)
    if len(set(ids)) == 1:
        return None
    got, mine = None, "invalid inputs"
    if shape is not None:
        b, s, h, d = shape
        got = choose(ids, b, s, h, d, dtype, chunks_gt1, seq)
        mine = f"{b}x{s}x{h}x{d} {dtype} pipelined={int(chunks_gt1)} seq_lens={seq} -> {got.mode} {got.shape}"
    seen = contract.agree(pg, "split", mine, "mode='auto''s split (cp_ops.split)")
    if got is None:
        return None
    if len(set(seen)) != 1:  # the ranks' calls differ: the 1-D path, whose checks name the difference
        w = pg.size()
        heur = modes.choose("auto", h, w)
        diff = [f"rank {r}: {v}" for r, v in enumerate(seen) if v != mine]
        return tuple(Split(heur, w if heur == "agkv" else 1, 1 if heur == "agkv" else w, "mismatch",
                           f"mode='auto' on a flat group across nodes: the ranks' calls differ (this rank: {mine}; "
                           f"{'; '.join(diff[:4])}): the 1-D path, whose checks name the difference"))
    if got.mode == "agkv_ulysses":
        _mesh(pg, got.outer, got.inner, device_type)
    return tuple(got)


decide._dynamo_marked_constant = True  # type: ignore[attr-defined] - torch.compiler.assume_constant_result


def spans_nodes(group_name: str) -> bool:
    """Whether the group's ranks are on more than one node (collective on the group's first call:
    :func:`cp_ops.node.group_nodes`). Marked constant for ``torch.compile``, as :func:`decide`."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return len(set(node.group_nodes(_resolve_process_group(group_name)))) > 1


spans_nodes._dynamo_marked_constant = True  # type: ignore[attr-defined] - torch.compiler.assume_constant_result


def _mesh(pg: dist.ProcessGroup, outer: int, inner: int, device_type: str):
    """The 2-D ``('agkv', 'ulysses')`` mesh of ``pg`` split ``outer × inner`` (group rank r = mesh rank r; built once,
    see the module docstring)."""
    key = (pg.group_name, outer, inner, device_type)
    got = _meshes.get(key)
    if got is not None:
        return got
    import datetime

    from torch.distributed.device_mesh import DeviceMesh

    from . import config

    ranks = dist.get_process_group_ranks(pg)
    grid = [ranks[o * inner:(o + 1) * inner] for o in range(outer)]
    o, i = divmod(pg.rank(), inner)
    timeout = datetime.timedelta(seconds=config.settings.timeout_s)
    row = dist.new_group(grid[o], timeout=timeout, use_local_synchronization=True)
    col = dist.new_group([grid[x][i] for x in range(outer)], timeout=timeout, use_local_synchronization=True)
    mesh = DeviceMesh.from_group([col, row], device_type, mesh=grid, mesh_dim_names=meshes.DIM_NAMES)
    _meshes[key] = mesh
    return mesh


def mesh_of(group_name: str, outer: int, inner: int, device_type: str):
    """The mesh :func:`decide` built for a 2-D split (eager and traced code read it here)."""
    return _meshes[(group_name, outer, inner, device_type)]


def for_call(pg: dist.ProcessGroup, q, seq_lens, chunks) -> Split | None:
    """The split of an eager ``mode='auto'`` call on the flat group ``pg`` (cached per shape: a dict lookup after the
    first call), or None: the 1-D heuristic as on one node (also for inputs the dispatcher will reject)."""
    if pg in _one_node:  # the common case: one dict lookup
        return None
    key = (pg, getattr(q, "shape", None), getattr(q, "dtype", None), seq_lens if type(seq_lens) is not list
           else tuple(seq_lens), chunks)
    try:
        got = _calls.get(key, _calls)
    except TypeError:  # unhashable seq_lens / chunks: decided each call (the dispatcher raises on a bad one)
        got, key = _calls, None
    if got is not _calls:
        return got
    if pg.size() == 1:
        _one_node.add(pg)
        return None
    req = _request(q, seq_lens, chunks)
    if req is None:  # this rank's inputs are wrong: still meet the others (on several nodes), then the 1-D checks
        got = decide(pg.group_name, None, "", False, None, "cpu")
    else:
        b, s, h, d, dtype, piped = req
        got = decide(pg.group_name, (b, s, h, d), dtype, piped, _seq(seq_lens, pg.size()), q.device.type)
    if got is None and req is not None:  # a valid request answered None: the group is on one node
        _one_node.add(pg)
    out = None if got is None else Split(*got)
    if key is not None and req is not None and (out is None or out.source != "mismatch"):
        _calls[key] = out  # not a mismatch: the next call agrees again (a rank that kept it would not meet the others)
    return out


def _seq(seq_lens, w: int):
    """``seq_lens`` as a tuple of W ints, or None (even shards; a bad one: None, the dispatcher raises)."""
    if seq_lens is None:
        return None
    try:
        seq = tuple(int(x) for x in seq_lens)
    except (TypeError, ValueError):
        return None
    return seq if len(seq) == w and min(seq, default=0) >= 0 else None


def known(pg: dist.ProcessGroup, q, seq_lens, chunks) -> Split | None | str:
    """What :func:`for_call` gives for this call without a collective: the :class:`Split`, None (one node, or
    inputs it leaves to the dispatcher), or ``'unknown'`` (the group's node layout is not known yet: no
    ``mode='auto'`` call on it so far)."""
    req = _request(q, seq_lens, chunks)
    if req is None or pg.size() == 1:
        return None
    ids = node.known_nodes(pg)
    if ids is None:
        return "unknown"
    if len(set(ids)) == 1:
        return None
    key = (pg, q.shape, q.dtype, seq_lens if type(seq_lens) is not list else tuple(seq_lens), chunks)
    if key in _calls:
        return _calls[key]
    b, s, h, d, dtype, piped = req
    return choose(ids, b, s, h, d, dtype, piped, _seq(seq_lens, pg.size()))


def forget() -> None:
    """Drop the cached splits (not the meshes: their groups live on)."""
    _calls.clear()
    _one_node.clear()


def _destroyed(pg: Any) -> None:
    forget()
    for key in [k for k in _meshes if k[0] == getattr(pg, "group_name", None)]:
        del _meshes[key]


contract.on_group_destroyed(_destroyed)
