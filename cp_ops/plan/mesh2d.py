"""The plan of a :func:`cp_ops.attention` call on a 2-D CP mesh (:mod:`cp_ops.mesh`): checks, decisions, one 2-D
mode body run with a :class:`~cp_ops.comm.MeshComm`; what a second group adds to the flat plan
(:mod:`cp_ops.plan.flat`). For users: ``docs/2d.md``; FP8 on a mesh: ``docs/fp8.md``.

**Rank contract.** Each dim's comm exchanges at its first launch over its own group (inner, then outer; the inner
tag carries the W ``seq_lens``, the outer the O row totals). A rank whose inputs fail tells both groups; one whose
inner exchange raises tells its outer group (eager; compiled: :func:`cp_ops.contract.set_partner`), so every rank
of the mesh raises instead of waiting. Eager calls take a :class:`MeshPlan` from :mod:`cp_ops.plan`'s cache; traced
calls run the body with two :class:`~cp_ops.comm.OpComm`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .. import comm_dtype as cd, contract, layout, mesh as meshes, modes, validate
from ..comm import MeshComm, OpCodec, OpComm
from ..group import resolve_group
from ..transport import base as transport_base
from . import flat, rules
from .call import Call

CALL = flat.CALL
MODE = "agkv_ulysses"


class MeshDecision(NamedTuple):
    """What a 2-D call runs (docs/2d.md). ``flat``: for a degenerate mesh, ``(dim name, 1-D mode)`` to
    run through :mod:`cp_ops.plan.flat` instead (``body`` is then None)."""

    info: meshes.MeshInfo
    mode: str
    inner_transport: str
    outer_transport: str
    chunks: int
    body: Any
    tag: int
    seq_lens: tuple | None
    rows: tuple | None
    has_mask: bool
    flat: tuple | None
    fmts: tuple = cd.NONE  # the formats of (q, k, v, o) on the links (cp_ops.comm_dtype.for_mode, 'agkv_ulysses')
    why: str = ""  # the mesh rule's reason (cp_ops.plan.rules.mesh_rule)


def decide(call: Call, info: meshes.MeshInfo, pgs=None) -> MeshDecision:
    """Check a 2-D call's inputs and make its decisions. ``pgs``: the (outer, inner) process groups a rank whose
    checks fail tells (None while tracing). Raises as :func:`cp_ops.attention`; besides, for a mode that is not 2-D,
    heads the inner size does not divide, K and V in different formats (the outer dim gathers both)."""
    q, k, v, mode, transport, scale, chunks = call.q, call.k, call.v, call.mode, call.transport, call.scale, call.chunks
    seq_lens, key_mask, tag, comm_dtype = call.seq_lens, call.key_mask, call.tag, call.comm_dtype
    compiling = torch.compiler.is_compiling()
    if tag is not None and compiling:
        tag = flat.constant(tag)
    O, I = info.outer, info.inner  # noqa: E741 - the mesh's dims
    chosen = MODE
    degenerate, c, why = rules.mesh_rule((O, I), mode, chunks if isinstance(chunks, int) else None)
    resolved = transport
    fmts, scale_word = cd.NONE, None

    def local_checks():
        nonlocal resolved, fmts, scale_word
        scale_word = contract.scale_field(scale)  # TypeError for a scale that is not a number
        if mode not in modes.names(dims=2):
            raise ValueError(f"mode on a 2-D CP mesh ({info.shape}, mesh_dim_names {meshes.DIM_NAMES}) must be one of "
                             f"{modes.names(dims=2)}; got {mode!r} (a 1-D mode runs on a 1-D group: pass "
                             "mesh['agkv'] or mesh['ulysses'], or a process group)")
        rules.check_chunks(chunks)
        validate.check_same(("q", "k", "v"), (q, k, v))
        layout.check_not_bhsd("q", q)
        fmts = cd.for_mode(cd.normalize(comm_dtype, q.dtype), MODE if degenerate is None else degenerate[1])
        h = q.shape[2]
        if (degenerate is None or degenerate[1] == "ulysses") and h % I:  # 1xI: 1-D Ulysses, the same rule
            raise ValueError(f"mode={MODE!r} on a {info.shape} mesh splits the heads over the inner ('ulysses') dim: "
                             f"its size must divide the head count; got heads={h}, inner size={I} (mesh {info.shape}): "
                             f"use a mesh whose inner size divides {h}")
        resolved = transport_base.resolve(transport, q.device.type)
        validate.check_device_for_backend(q, info.inner_backend)
        validate.check_device_for_backend(q, info.outer_backend)
        if seq_lens is not None:
            layout.check_seq_lens(seq_lens, info.world, info.rank, q.shape[1])
        if key_mask is not None:
            total = sum(seq_lens) if seq_lens is not None else info.world * q.shape[1]
            if isinstance(key_mask, torch.Tensor) and key_mask.dim() == 2 and key_mask.shape[1] == total \
                    and total != q.shape[1]:
                raise ValueError(f"a key mask of every key ([B, S_total] = {list(key_mask.shape)}) is not supported on "
                                 f"a 2-D CP mesh; pass this rank's [B, S_local] = [{q.shape[0]}, {q.shape[1]}]")
            layout.check_key_mask(key_mask, q)
            flat.check_mask_chunks(MODE, chunks)
        if tag is not None:
            contract.variant_tag(tag=tag)

    try:
        local_checks()
    except (ValueError, RuntimeError, TypeError) as e:
        if not compiling and pgs is not None and info.world > 1:
            # inner first: the order of the body's first launches; a degenerate mesh: the group of its 1-D call
            told = pgs[::-1] if degenerate is None else [pgs[0] if degenerate[0] == "agkv" else pgs[1]]
            for pg in told:
                contract.exchange(pg, CALL, "", failed=e)
        raise
    if compiling:
        c = flat._constant(flat.constant(c))
    seq = tuple(seq_lens) if seq_lens is not None else None
    rows = meshes.row_lens(seq, O, I) if seq is not None else None
    t = contract.variant_tag(mode=chosen, chunks=c, mesh=(O, I), key_mask="given" if key_mask is not None else "None",
                             tag=tag, comm_dtype=cd.tag(fmts), scale=scale_word)
    body = None if degenerate is not None or info.world == 1 else modes.body(chosen, c)
    return MeshDecision(info, chosen, resolved, rules.outer_transport(resolved), c, body, t, seq, rows,
                        key_mask is not None, degenerate, fmts, why)


def _shards(d: MeshDecision, q) -> meshes.MeshShards | None:
    if d.seq_lens is None and not d.has_mask:
        return None
    return meshes.MeshShards(d.seq_lens, d.info, q.shape[1], q.device)


def traced(call: Call) -> torch.Tensor:
    """The traced path of a call on the 2-D mesh ``call.group``. Shapes and errors as :func:`cp_ops.attention`."""
    group = call.group
    info = meshes.MeshInfo(*meshes.describe(group))
    eager = not torch.compiler.is_compiling()
    d = decide(call, info, meshes.groups(group) if eager else None)
    if d.flat is not None:
        return flat.traced(call.replace(group=group[d.flat[0]], mode=d.flat[1]), group[d.flat[0]].get_group())
    if info.world == 1:
        return flat.one_rank(call, d.fmts, kv_trips=2)
    tag = contract.set_partner(info.inner_name, d.tag, info.outer_name)  # a failed row exchange tells the column
    inner = OpComm(info.inner, info.inner_name, d.inner_transport, CALL, tag, info.i, d.seq_lens, OpCodec(d.fmts))
    outer = OpComm(info.outer, info.outer_name, d.outer_transport, CALL, d.tag, info.o, d.rows,
                   OpCodec(cd.outer(d.fmts)))
    comm = MeshComm(outer, inner)
    return d.body(call.q, call.k, call.v, comm, scale=call.scale, chunks=d.chunks, shards=_shards(d, call.q),
                  key_mask=call.key_mask)


def describe(call: Call):
    """What a call on the 2-D mesh ``call.group`` runs, without a collective (:func:`cp_ops.describe`): a degenerate
    mesh's 1-D call, else mode 'agkv_ulysses' with the caller's chunks or 1 and the inner dim's transport."""
    group, q, mode, chunks = call.group, call.q, call.mode, call.chunks
    info = meshes.MeshInfo(*meshes.describe(group))
    d = decide(call.replace(k=q, v=q, tag=None, scale=None), info)
    if d.flat is not None:
        sub = group[d.flat[0]]
        return flat.describe(call.replace(group=sub, mode=d.flat[1]), sub.get_group(), mode_why=d.why)
    if info.world == 1:
        return flat.measured.Choice(MODE, 1, "heuristic", {}, d.inner_transport, d.why)
    shown = transport_base.agreed_name(d.inner_transport, info.inner_name, q.device) or "auto"
    src = "explicit" if mode != "auto" and chunks is not None else "heuristic"
    return flat.measured.Choice(d.mode, d.chunks, src, {}, shown, d.why)


# ---- the eager path -------------------------------------------------------------------------------------------------
class MeshPlan:
    """What every eager 2-D call with one key runs: ``run(call)`` → output."""

    __slots__ = ("pgs", "d", "shards", "comm", "epoch", "device")

    def __init__(self, pgs, d: MeshDecision, shards, device):
        self.pgs, self.d, self.shards, self.device = pgs, d, shards, device
        self.comm, self.epoch = None, -1

    def run(self, call: Call):
        d = self.d
        if self.epoch != transport_base.epoch:
            outer_pg, inner_pg = self.pgs
            self.comm = MeshComm(flat.direct_comm(outer_pg, d.outer_transport, d.tag, d.rows, cd.outer(d.fmts),
                                                  self.device),
                                 flat.direct_comm(inner_pg, d.inner_transport, d.tag, d.seq_lens, d.fmts, self.device))
            self.epoch = transport_base.epoch
        comm = self.comm
        comm.inner.armed = comm.outer.armed = True
        try:
            return d.body(call.q, call.k, call.v, comm, scale=call.scale, chunks=d.chunks, shards=self.shards,
                          key_mask=call.key_mask)
        except BaseException as e:
            comm.drain()
            # the inner exchange raised: tell the outer group too — unless a row peer was late (a timeout): then the
            # column's peers time out on their own and a retry meets, with no extra exchange counted on the column
            if comm.outer.armed and not comm.inner.armed and not isinstance(e, contract.PeersTimeout):
                comm.outer.armed = False
                try:
                    contract.exchange(comm.outer.pg, CALL, "", failed=e if isinstance(e, Exception) else None)
                except Exception:  # noqa: BLE001 - the body's error is the one raised
                    pass
            raise


class _Local:
    __slots__ = ("fmts",)

    def __init__(self, fmts):
        self.fmts = fmts

    def run(self, call: Call):
        return flat.one_rank(call, self.fmts, kv_trips=2)


def same_groups(plan, mesh) -> bool:
    """Whether ``plan`` (built for a mesh equal to ``mesh``) runs on ``mesh``'s process groups."""
    pgs = meshes.groups(mesh)
    if isinstance(plan, MeshPlan):
        return plan.pgs[0] is pgs[0] and plan.pgs[1] is pgs[1]
    if isinstance(plan, flat.Rerouted):
        return plan.pg is pgs[0] or plan.pg is pgs[1]
    return True  # local attention or nothing to move: no group


def build(call: Call):
    """The eager plan of a call on the 2-D mesh ``call.group`` (None: nothing to move). Raises as :func:`decide`."""
    resolve_group(None)  # RuntimeError when torch.distributed is not initialized
    group, q = call.group, call.q
    info = meshes.MeshInfo(*meshes.describe(group))
    pgs = meshes.groups(group)
    d = decide(call, info, pgs)
    if d.flat is not None:
        sub = group[d.flat[0]]
        pg = pgs[0] if d.flat[0] == "agkv" else pgs[1]
        plan = flat.build(call.replace(group=sub, mode=d.flat[1]), pg, d.why)
        return flat.Rerouted(pg, d.flat, lambda c: c.replace(group=sub, mode=d.flat[1]), plan,
                             lambda c: flat.traced(c, pg))
    if info.world == 1:
        return _Local(d.fmts)
    shards = _shards(d, q)
    rows = shards.inner.smax if shards is not None else q.shape[1]
    if q.shape[0] * rows * q.shape[2] * q.shape[3] == 0:
        return None  # nothing to move: the ops' empty path
    return MeshPlan(pgs, d, shards, q.device)
