"""Which ranks share a node (cp_ops never assumes one host): ranks with equal node identities, ``CP_OPS_NODE_ID``
where set (per rank), else the host name (``docs/settings.md``, ``docs/2d.md``).
"""

from __future__ import annotations

import weakref

import torch.distributed as dist

from ._peers import node_id  # noqa: F401 - the rule lives with the peers' identities (no import cycle)

#: group name -> (a weak reference to the group, its ranks' identities): a group destroyed and another made under the
#: same name (torch reuses names after destroy_process_group) is asked again, not answered from the old one's ranks
_groups: dict[str, tuple[weakref.ref, tuple[str, ...]]] = {}


def group_nodes(group: dist.ProcessGroup) -> tuple[str, ...]:
    """Each rank's node identity, in group-rank order (collective the first time, cached per group object).
    RuntimeError: not every rank of the group called it within ``CP_OPS_TIMEOUT_S`` (named)."""
    got = _groups.get(group.group_name)
    if got is None or got[0]() is not group:
        from .contract import agree

        ids = tuple(agree(group, "node", node_id(), "which ranks share a node"))
        got = _groups[group.group_name] = (weakref.ref(group), ids)
    return got[1]


def known_nodes(group: dist.ProcessGroup) -> tuple[str, ...] | None:
    """What :func:`group_nodes` answered for ``group`` so far, without a collective; None: not asked yet."""
    got = _groups.get(group.group_name)
    return got[1] if got is not None and got[0]() is group else None


def layout(ids) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of the node identities ``ids`` (group-rank order). Raises ValueError when the nodes
    hold different rank counts (the 2-D mesh and the cost model assume equal nodes)."""
    counts: dict[str, int] = {}
    for n in ids:
        counts[n] = counts.get(n, 0) + 1
    per = set(counts.values())
    if len(per) != 1:
        raise ValueError(f"the ranks are spread unevenly over the nodes: {counts} (ranks per node identity, "
                         "CP_OPS_NODE_ID or the host name); a 2-D CP mesh needs the same rank count on every node")
    return len(counts), per.pop()


def node_major(ids) -> bool:
    """Whether the ranks are numbered node by node (ranks 0..G-1 on one node, G..2G-1 on the next, ...): torchrun's
    order, which a ``(nodes, ranks per node)`` mesh needs to keep each row on one node."""
    seen, last = set(), None
    for n in ids:
        if n != last:
            if n in seen:
                return False
            seen.add(n)
            last = n
    return True
