"""Undo a failed rewrite: snapshots of an FX graph and of Inductor scheduler nodes that put them back as they were.

The overlap pass (:mod:`cp_ops.passes.overlap`) and the scheduler pass (:mod:`cp_ops.passes.pin`) change their
input in place, in several steps. When a step fails (a bug, an unexpected graph) or the result breaks a rule the
pass checks at the end, the input is restored from a snapshot taken before: never a half-moved graph.
"""

from __future__ import annotations

import torch.fx as fx


class GraphSnapshot:
    """The nodes of ``graph`` in order, each one's ``args``/``kwargs`` and its ``meta``: a shallow copy, or with
    ``meta_keys`` only those keys' values (cheaper: a pass that writes no other key of the nodes it did not create
    names them; the overlap pass takes one snapshot per launch, O(nodes) each).

    :meth:`restore` erases every node added since, puts back the inputs, the order and the ``meta`` (those keys) of
    the nodes it saw. Nodes must not be *erased* between the snapshot and a restore (the pass defers erasing the
    nodes it replaces until it has succeeded).
    """

    _ABSENT = object()

    def __init__(self, graph: fx.Graph, meta_keys: tuple[str, ...] | None = None) -> None:
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.inputs = [(n._args, n._kwargs) for n in self.nodes]  # the attributes behind Node.args / Node.kwargs
        self.meta_keys = meta_keys
        if meta_keys is None:
            self.meta = [dict(n.meta) for n in self.nodes]
        else:
            absents = (self._ABSENT,) * len(meta_keys)
            self.meta = [tuple(map(n.meta.get, meta_keys, absents)) for n in self.nodes]

    def restore(self) -> None:
        """Put the graph back as it was at the snapshot. Raises RuntimeError when a node seen then was erased
        since (that cannot be undone)."""
        gone = [n.name for n in self.nodes if getattr(n, "_erased", False)]
        if gone:
            raise RuntimeError(f"cp_ops.passes: cannot restore the graph: nodes {gone} were erased since the snapshot")
        keep = set(self.nodes)
        for n, (args, kwargs) in zip(self.nodes, self.inputs):  # first the inputs: no node seen then uses an added
            if n.args is not args:                                 # node any more
                n.args = args
            if n.kwargs is not kwargs:
                n.kwargs = kwargs
        added = [n for n in self.graph.nodes if n not in keep]
        while added:  # users first, whatever order a failed rewrite left them in
            free = [n for n in added if not n.users]
            if not free:
                raise RuntimeError(f"cp_ops.passes: cannot restore the graph: added nodes {[n.name for n in added]} "
                                   "use each other in a cycle")
            for n in free:
                self.graph.erase_node(n)
            added = [n for n in added if n not in set(free)]
        first = next(iter(self.graph.nodes))
        if first is not self.nodes[0]:
            first.prepend(self.nodes[0])
        for prev, n in zip(self.nodes, self.nodes[1:]):
            if prev.next is not n:
                prev.append(n)
        if self.meta_keys is None:
            for n, saved in zip(self.nodes, self.meta):
                if n.meta.keys() != saved.keys() or any(n.meta[k] is not v for k, v in saved.items()):
                    n.meta.clear()
                    n.meta.update(saved)
            return
        absent = self._ABSENT
        for n, saved in zip(self.nodes, self.meta):
            for k, v in zip(self.meta_keys, saved):
                if v is absent:
                    n.meta.pop(k, None)
                elif n.meta.get(k, absent) is not v:
                    n.meta[k] = v


class SchedulerSnapshot:
    """The dependency state of Inductor scheduler nodes (``read_writes``, ``unmet_dependencies``, ``ancestors``,
    ``min_order``/``max_order``): :meth:`restore` drops every ordering dependency added since and the ancestors
    computed from them."""

    _FIELDS = ("read_writes", "unmet_dependencies", "ancestors", "min_order", "max_order")

    def __init__(self, snodes: list) -> None:
        self.saved = [(sn, {f: getattr(sn, f) for f in self._FIELDS if hasattr(sn, f)}) for sn in snodes]

    def restore(self) -> None:
        for sn, fields in self.saved:
            for f, v in fields.items():
                setattr(sn, f, v)
            clear = getattr(sn, "clear_read_writes_dependent_caches", None)
            if clear is not None:
                clear()
