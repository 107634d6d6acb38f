"""The one home of a call's decision: :func:`run` takes a :class:`~cp_ops.plan.call.Call` to the body that runs it;
:func:`describe` says what it runs and why (``docs/architecture.md``). Eager calls look their plan up by
:meth:`Call.key` in one dict, 1-D and 2-D alike; traced calls (``torch.compile``, dispatch modes) decide per call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import contract
from ..group import resolve_group
from ..mesh import is_mesh
from . import flat, measured, mesh2d, split
from .call import Call, make

__all__ = ["Call", "make", "run", "describe", "forget"]

_MAX_PLANS = 1024  # distinct keys kept (a model has a handful; a shape sweep clears and refills)
_plans: dict = {}


def run(call: Call) -> torch.Tensor:
    """Run one CP attention call (inputs detached by the caller): its eager plan where it applies, else the traced
    path. Shapes and errors as :func:`cp_ops.attention`."""
    if not torch.compiler.is_compiling():
        try:
            key = call.key()
            e = _plans.get(key) if key is not None else None
        except (AttributeError, TypeError):  # not tensors, an unhashable group: the traced path raises the error
            key = e = None
        if e is not None and e[1] is (dist.group.WORLD if call.group is None else call.group):
            plan = e[0]  # a repeated call on its plan's group
        else:
            plan = None if key is None else _lookup(call, key, e)
        if plan is not None:  # (None: nothing to move, or the traced path)
            return plan.run(call)
    return _traced(call)


def _traced(call: Call) -> torch.Tensor:
    if is_mesh(call.group):
        return mesh2d.traced(call)
    pg = resolve_group(call.group)
    s = split.route(call, pg)
    if s is None or s.source != "cost":
        return flat.traced(call, pg)
    if s.mode == "agkv_ulysses":
        return mesh2d.traced(_on_mesh(call, pg, s))
    return flat.traced(call.replace(mode=s.mode), pg)


def _on_mesh(call: Call, pg, s: split.Split) -> Call:
    """``call`` on the 2-D mesh the split built from its flat group ``pg``: a ``[B, S_total]`` key mask becomes this
    rank's ``[B, S_local]`` slice (mesh rank r = group rank r holds the r-th token block)."""
    mesh = split.mesh_of(pg.group_name, s.outer, s.inner, call.q.device.type)
    return call.replace(group=mesh, mode="auto", key_mask=split.local_mask(call, pg))


def _build(call: Call):
    """``(plan, keep)``: the plan of the call's first use (None: nothing to move) and whether to cache it (not where
    the ranks' calls differed at the split's agreement)."""
    if is_mesh(call.group):
        return mesh2d.build(call), True
    pg = resolve_group(call.group)
    s = split.route(call, pg)
    if s is None or s.source != "cost":
        return flat.build(call, pg), s is None
    if s.mode == "agkv_ulysses":
        on_mesh = lambda c: _on_mesh(c, pg, s)  # noqa: E731
        return flat.Rerouted(pg, s, on_mesh, mesh2d.build(on_mesh(call)), _traced), True
    as_mode = lambda c: c.replace(mode=s.mode)  # noqa: E731
    return flat.Rerouted(pg, s, as_mode, flat.build(as_mode(call), pg), _traced), True


def _lookup(call: Call, key, e):
    """The plan for this call under ``key`` (built and cached at its key's first call; ``e``: the cache's entry, a
    plan for another group object), or None: take the traced path."""
    group = call.group
    if e is not None:
        if not _same_groups(e[0], group):
            _plans.pop(key, None)
            return None
        _plans[key] = (e[0], group)  # another mesh object over the plan's groups (e.g. a fresh slice of a larger mesh)
        return e[0]
    plan, keep = _build(call)
    if keep:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = (plan, dist.group.WORLD if group is None else group)
    return plan


def _same_groups(plan, group) -> bool:
    """Whether a plan cached under an equal key runs on ``group``'s process groups (the default group may have been
    replaced; a DeviceMesh compares by its layout, so a new one equals a destroyed one)."""
    if group is None or plan is None:
        return False
    return mesh2d.same_groups(plan, group) if is_mesh(group) else getattr(plan, "pg", None) is resolve_group(group)


def describe(call: Call) -> measured.Choice:
    """What a call runs, without a collective (:func:`cp_ops.describe`: arguments, return and errors there)."""
    if is_mesh(call.group):
        return mesh2d.describe(call)
    pg = resolve_group(call.group)
    c = flat.describe(call, pg)  # the checks, as the call
    s = split.known(call, pg)
    if s is None:  # one node, or before the group's first call: answered as for one node (local, no collective)
        return c
    if s.source != "cost":
        return c._replace(why=s.why + "; " + c.why)
    if s.mode == "agkv_ulysses":
        mesh = split.mesh_of(pg.group_name, s.outer, s.inner, call.q.device.type)
        if mesh is None:
            return measured.Choice(s.mode, 1 if call.chunks is None else call.chunks, "cost", {}, "auto",
                                   s.why + "; the mesh is built by the first call")
        c = mesh2d.describe(call.replace(group=mesh, mode="auto", key_mask=split.local_mask(call, pg)))
    else:
        c = flat.describe(call.replace(mode=s.mode), pg)
    return c._replace(source="cost", why=s.why + "; " + c.why)


def forget() -> None:
    """Drop every cached plan and stored choice (the next call of each key decides again; the cache file stays)."""
    _plans.clear()
    measured._memo.clear()


def _destroyed(pg) -> None:
    """Drop what cp_ops made for a group it notices destroyed: plans, stored choices, the split's meshes."""
    _plans.clear()
    measured.drop_destroyed()
    split.release(pg)


contract.on_group_destroyed(_destroyed)
