"""The scheduler pass of cp_ops (``torch._inductor.config._pre_fusion_custom_pass``): keep each overlap window's
order, and each launch's in-flight bound, in the generated code.

The FX pass (:mod:`cp_ops.passes.overlap`) orders each window launch → Q-side nodes → wait in the post-grad graph
and tags the nodes (``node.meta[TAG]``; ``node.meta[AFTER]`` for a launch placed after older launches' readers).
Inductor's own reordering (fusion, e.g. Q RoPE with K RoPE; ``reorder_for_peak_memory``) may undo that order;
:func:`pin_windows` adds ordering dependencies (fake ``WeakDep``, which do not extend buffer lifetimes) launch →
Q-side kernels → wait, and reader → later launch, which fusion and reordering respect.

On a failure partway the scheduler nodes' dependencies are restored (:class:`cp_ops.passes.rollback.SchedulerSnapshot`)
and the nodes returned in their order, with a warning (an error when :data:`cp_ops.passes.overlap.STRICT`).
"""

from __future__ import annotations

import logging

from . import overlap
from .overlap import AFTER, TAG
from .rollback import SchedulerSnapshot

log = logging.getLogger("cp_ops.passes")


def _snode_tags(snode) -> set[tuple[int, str]]:
    tags = set()
    for sub in snode.get_nodes():
        node = getattr(sub, "node", None)
        for origin in getattr(node, "origins", ()) or ():
            tag = origin.meta.get(TAG) if hasattr(origin, "meta") else None
            if tag is not None:
                tags.add(tag)
    return tags


def _weak_dep(name: str, mutating_buf: str):
    from torch._inductor.dependencies import WeakDep

    try:
        return WeakDep(name, mutating_buf=mutating_buf, is_fake=True)
    except TypeError:  # older Inductor: no is_fake
        return WeakDep(name, mutating_buf=mutating_buf)


def _gather_window(snodes: list, launch, q_tagged: list, waits: list) -> tuple[list, list]:
    """Bring the window's Q-side scheduler nodes between the launch and the first wait.

    Inductor realizes some Q buffers only where attention reads them (e.g. the RoPE output), which puts them
    after the waits in its first node order. Those that do not depend on a wait — and whose other
    dependencies are all before the first wait — move to right before it. Returns (new order, Q nodes in it).
    """
    pos = {sn: i for i, sn in enumerate(snodes)}
    first_wait = min(pos[x] for x in waits)
    wait_names = {x.get_name() for x in waits}
    inside = [sn for sn in q_tagged if pos[launch] < pos[sn] < first_wait]
    before_names = {sn.get_name() for sn in snodes[:first_wait]}
    late = []
    for sn in sorted((sn for sn in q_tagged if pos[sn] > first_wait), key=pos.__getitem__):
        anc = set(getattr(sn, "ancestors", ()) or ())
        if anc & wait_names or not anc <= before_names | {x.get_name() for x in late}:
            continue
        late.append(sn)
    if late:
        late_set = set(late)
        rest = [sn for sn in snodes if sn not in late_set]
        i = rest.index(snodes[first_wait])
        snodes = rest[:i] + late + rest[i:]
    return snodes, inside + late


def _origins(snode) -> list:
    out = []
    for sub in snode.get_nodes():
        out.extend(o for o in (getattr(getattr(sub, "node", None), "origins", ()) or ()) if hasattr(o, "meta"))
    return out


def _pin_inflight_bounds(snodes: list) -> bool:
    """Keep each launch the FX pass placed after older launches' readers (``meta[AFTER]``) after them in the
    generated code: an ordering dependency (fake ``WeakDep``) of the launch on every scheduler node that holds
    one of those readers. Recomputes ancestors when it adds any; returns whether it did."""
    from torch._inductor import ir

    pos = {sn: i for i, sn in enumerate(snodes)}
    by_origin: dict[str, list] = {}
    for sn in snodes:
        for o in _origins(sn):
            by_origin.setdefault(o.name, []).append(sn)
    added = False
    for sn in snodes:
        node = getattr(sn, "node", None)
        if not isinstance(node, ir._CollectiveKernel) or isinstance(node, ir._WaitKernel):
            continue
        names = [r for o in _origins(sn) for r in (o.meta.get(AFTER) or ())]
        if not names:
            continue
        launch_buf = sorted(sn.get_buffer_names())[0]
        for reader in {r for name in names for r in by_origin.get(name, ())}:
            if reader is sn:
                continue
            if pos[reader] > pos[sn] or sn.get_name() in (getattr(reader, "ancestors", ()) or ()):
                msg = f"{sn.get_name()} cannot be kept after {reader.get_name()} (a reader of an older launch's output)"
                if overlap.STRICT:
                    raise RuntimeError(f"cp_ops overlap pass: {msg}")
                log.warning("cp_ops.passes: %s", msg)
                continue
            for buf in reader.get_buffer_names():
                sn.add_fake_dep(_weak_dep(buf, launch_buf))
                added = True
        log.debug("cp_ops.passes: %s pinned after %s", sn.get_name(), names)
    if added:
        from torch._inductor.virtualized import V

        V.graph.scheduler.compute_ancestors()
    return added


def pin_windows(snodes: list) -> list:
    """:func:`_pin_windows`; on an error, the dependencies it added removed again, a warning and the nodes
    unchanged in order (an error when :data:`cp_ops.passes.overlap.STRICT`)."""
    snapshot = SchedulerSnapshot(snodes)
    try:
        return _pin_windows(snodes)
    except Exception as e:  # noqa: BLE001 - an optimization must not break the user's compile
        snapshot.restore()
        if overlap.STRICT:
            raise
        log.warning(
            "cp_ops.passes: windows not pinned in the scheduler (its dependencies undone; Inductor may reorder the "
            "Q kernels out of the windows): %s: %s", type(e).__name__, e,
        )
        return snodes


def _pin_windows(snodes: list) -> list:
    """Inductor scheduler pass (``config._pre_fusion_custom_pass``): pin each window's order.

    For every window tagged by :func:`overlap_kv_communication`, each Q-side scheduler node gets an ordering
    dependency (a fake ``WeakDep``, which does not extend buffer lifetimes) on the launch, and each wait gets
    one on every Q-side node. Fusion and ``reorder_for_peak_memory`` respect them, so the generated code
    keeps launch → Q kernels → wait. Returns ``snodes`` (same order).
    """
    from torch._inductor import ir

    changed = _pin_inflight_bounds(snodes)
    windows: dict[int, dict[str, list]] = {}
    for sn in snodes:
        tags = _snode_tags(sn)
        roles = {}
        for wid, role in tags:
            roles.setdefault(wid, set()).add(role)
        for wid, rs in roles.items():
            node = getattr(sn, "node", None)
            if "wait" in rs and isinstance(node, ir._WaitKernel):
                role = "wait"
            elif "launch" in rs and isinstance(node, ir._CollectiveKernel) and not isinstance(node, ir._WaitKernel):
                role = "launch"
            elif rs & {"launch", "wait"}:
                continue  # input copies and output views made while lowering the launch or wait
            else:
                role = "q"
            windows.setdefault(wid, {"launch": [], "q": [], "wait": []})[role].append(sn)
    if not windows:
        if changed:
            from torch._inductor.virtualized import V

            V.graph.scheduler.compute_ancestors()
        return snodes
    for wid, w in sorted(windows.items()):
        if len(w["launch"]) != 1 or not w["wait"]:
            log.debug("cp_ops.passes: window %d not pinned: launch/wait not found among scheduler nodes", wid)
            continue
        launch = w["launch"][0]
        launch_anc = set(getattr(launch, "ancestors", ()) or ())
        q_tagged = [sn for sn in w["q"] if sn.get_name() not in launch_anc]  # never create a cycle
        snodes, q_nodes = _gather_window(snodes, launch, q_tagged, w["wait"])
        launch_buf = sorted(launch.get_buffer_names())[0]
        for sn in q_nodes:
            sn.add_fake_dep(_weak_dep(launch_buf, sorted(sn.get_buffer_names())[0]))
        for wait in w["wait"]:
            wait_buf = sorted(wait.get_buffer_names())[0]
            for sn in q_nodes:
                for buf in sn.get_buffer_names():
                    wait.add_fake_dep(_weak_dep(buf, wait_buf))
        changed = changed or bool(q_nodes)
        log.debug(
            "cp_ops.passes: window %d pinned in the scheduler: %s → %s → %s",
            wid, launch.get_name(), [sn.get_name() for sn in q_nodes], [x.get_name() for x in w["wait"]],
        )
    if changed:
        from torch._inductor.virtualized import V

        V.graph.scheduler.nodes = snodes
        V.graph.scheduler.compute_ancestors()
    return snodes
