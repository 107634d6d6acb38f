"""The K/V-communication overlap pass: open a window from each K/V launch to its wait and put the Q work in it.

A DiT attention block computes Q, K and V from the same input, then attention needs all three. With context
parallelism, K and V (AGKV: all-gather; Ulysses: all-to-all) must travel before attention, and nothing but
Q's own chain — projection GEMM, norm, RoPE — is independent of them. Models often compute Q first (Wan
does), so as traced the launch comes after the Q work and the communication is fully exposed. This pass
rewrites the post-grad FX graph so that it runs

    K chain, V chain → K/V launch → Q projection → Q norm → Q RoPE (→ Q launch, Ulysses) → wait → attention

Steps, per cp_ops launch in graph order (the shape of ``torch/_inductor/fx_passes/micro_pipeline_tp.py``:
find, check, rewrite):

1. ``_split_packed_launch``: a ``cp_ops::ulysses_start([q, k, v])`` whose buffer is only read through
   ``select(buf, 3, slot)`` becomes ``ulysses_start([k, v])`` + ``ulysses_start([q])``; the slots read are
   remapped, so values are bitwise equal (an all-to-all moves bytes; the slot axis only changes strides).
   Q's slot is the one that reaches the attention op's ``query`` argument.
2. ``_open_window``: the Q side of a window is every node the attention depends on and the launch does
   not. Q-side nodes before the launch (and anything that uses them) move to after it, keeping their order;
   then the launch rises to right after its last input (K after its norm and RoPE, V after its projection).
3. ``_sink_wait``: each wait moves to right before its first user.
4. The window's nodes are tagged (``node.meta``); :func:`pin_windows`, a scheduler pass, then adds ordering
   dependencies launch → Q-side kernels → wait, so that Inductor's own reordering (fusion, e.g. Q RoPE with
   K RoPE; ``reorder_for_peak_memory``) keeps the Q kernels inside the window in the generated code.

A fused QKV projection (one GEMM) is kept whole: splitting it would change the GEMM's shape, speed and
numerics. The window then holds the Q-side work after that GEMM (norm, RoPE), and the debug log says so.
Graphs without cp_ops launches are not touched.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

from cp_ops.ops import KV_LAUNCH_OPS, LAUNCH_OPS
from cp_ops.transport.base import inflight_limit

log = logging.getLogger("cp_ops.passes")

aten = torch.ops.aten
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_KV_LAUNCHES = frozenset(KV_LAUNCH_OPS)  # the pass opens a window from each (cp_ops.ops's ops table)
_LAUNCHES = frozenset(LAUNCH_OPS)  # every launch: all count towards the in-flight bound
AFTER = "cp_ops_after"  # node.meta key of a launch placed after another's consumption: (token, consumer nodes)
TAG = "cp_ops_window"  # node.meta key: (window id, role) with role in {"launch", "q", "wait"}
STRICT = False  # True: a failure inside the pass raises instead of leaving that launch alone with a warning

# Ops that only re-view or copy a tensor: followed through when looking for the op that consumes it.
_LAYOUT_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.select.int,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.clone.default,
    aten.alias.default,
    aten.as_strided.default,
    aten.contiguous.default,
    operator.getitem,
}
_GEMM_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default}


def _is_call(n: fx.Node, targets) -> bool:
    return n.op == "call_function" and n.target in targets


def _is_attention(n: fx.Node) -> bool:
    name = getattr(n.target, "__name__", str(n.target))
    return n.op == "call_function" and ("scaled_dot_product" in name or "flex_attention" in name)


def _ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return seen


def _waits_of(launch: fx.Node) -> list[fx.Node]:
    """The ``wait_tensor`` nodes on the launch's outputs (directly or through ``getitem``)."""
    waits = []
    for u in launch.users:
        if _is_call(u, {_WAIT}):
            waits.append(u)
        elif _is_call(u, {operator.getitem}):
            waits.extend(w for w in u.users if _is_call(w, {_WAIT}))
    return waits


def _first_compute_users(n: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """(consumer, input it reads) for the first non-layout ops that read ``n`` through layout ops."""
    out, stack, seen = [], [n], set()
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u in seen:
                continue
            seen.add(u)
            if _is_call(u, _LAYOUT_OPS):
                stack.append(u)
            else:
                out.append((u, cur))
    return out


def _find_attention(waits: list[fx.Node], order: dict[fx.Node, int]) -> fx.Node | None:
    """The attention op fed by the waits: the earliest non-layout consumer (an SDPA op when there is one);
    None when the waited tensors only leave the graph (nothing to overlap with)."""
    users = [u for w in waits for u, _ in _first_compute_users(w) if u.op == "call_function"]
    if not users:
        return None
    attn = [u for u in users if _is_attention(u)]
    return min(attn or users, key=order.__getitem__)


def _fake_val(target, args):
    """``meta['val']`` for a new node: run ``target`` on the fake values of its arguments."""
    vals = fx.node.map_arg(args, lambda a: a.meta["val"])
    with _detect_fake_mode(vals):
        return target(*vals)


def _detect_fake_mode(vals):
    from torch._guards import detect_fake_mode

    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(flat)
    if mode is None:
        raise RuntimeError("cp_ops overlap pass: no fake mode on the graph's values (meta['val'] missing)")
    return mode


def _new_call(graph: fx.Graph, target, args, like: fx.Node) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta = {k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")}
    node.meta["val"] = _fake_val(target, args)
    return node


# ---- step 1: Ulysses [q, k, v] → [k, v] + [q] ----------------------------------------------------
def _query_slots(wait: fx.Node, selects: list[fx.Node]) -> set[int] | None:
    """Slots whose unpacked tensor reaches an attention op as its query (argument 0); None if unknown."""
    q_slots, known = set(), False
    for sel in selects:
        for consumer, via in _first_compute_users(sel):
            if _is_attention(consumer):
                known = True
                if consumer.args and consumer.args[0] is via:
                    q_slots.add(sel.args[2])
    return q_slots if known else None


def _split_packed_launch(graph: fx.Graph, launch: fx.Node, order: dict[fx.Node, int]) -> fx.Node | None:
    """Rewrite a packing launch (``ulysses_start([..q..k..v..])``: its first argument a list) into a K/V launch plus a Q launch; returns the K/V launch.

    Returns None (graph unchanged, reason logged) when the buffer is used other than through one wait and
    ``select(buf, 3, slot)`` views, or the query slot cannot be told from the attention op.
    """
    xs, world_size, group_name, transport = launch.args
    if len(xs) < 2:
        return None
    waits = _waits_of(launch)
    if len(launch.users) != 1 or len(waits) != 1:
        log.debug("cp_ops.passes: %s kept whole: its buffer has users other than one wait", launch.name)
        return None
    wait = waits[0]
    selects = list(wait.users)
    if not all(_is_call(s, {aten.select.int}) and s.args[1] in (3, -3) and isinstance(s.args[2], int) for s in selects):
        log.debug("cp_ops.passes: %s kept whole: its buffer is read other than by select(buf, 3, slot)", launch.name)
        return None
    q_slots = _query_slots(wait, selects)
    if not q_slots or len(q_slots) == len(xs):
        log.debug("cp_ops.passes: %s kept whole: cannot tell the query slot (found %s)", launch.name, q_slots)
        return None
    kv = [i for i in range(len(xs)) if i not in q_slots]
    q = sorted(q_slots)
    with graph.inserting_before(launch):
        launch_kv = _new_call(graph, launch.target, ([xs[i] for i in kv], world_size, group_name, transport), launch)
        launch_q = _new_call(graph, launch.target, ([xs[i] for i in q], world_size, group_name, transport), launch)
    with graph.inserting_before(wait):
        wait_kv = _new_call(graph, _WAIT, (launch_kv,), wait)
        wait_q = _new_call(graph, _WAIT, (launch_q,), wait)
    for sel in selects:
        slot = sel.args[2]
        src, new_slot = (wait_kv, kv.index(slot)) if slot in kv else (wait_q, q.index(slot))
        sel.args = (src, 3, new_slot)
        sel.meta["val"] = _fake_val(sel.target, sel.args)
    graph.erase_node(wait)
    graph.erase_node(launch)
    log.debug(
        "cp_ops.passes: split %s into %s (slots %s: K/V) and %s (slots %s: Q)",
        launch.name, launch_kv.name, kv, launch_q.name, q,
    )
    return launch_kv


# ---- steps 2 and 3: open the window, sink the waits --------------------------------------------
def _fused_projection(q_side: set[fx.Node], launch_anc: set[fx.Node]) -> fx.Node | None:
    """A GEMM that feeds both the launch and the Q side directly (through layout ops): a fused QKV GEMM."""
    for s in q_side:
        if _is_call(s, _GEMM_OPS):
            continue
        for i in s.all_input_nodes:
            cur = i
            while cur in launch_anc and _is_call(cur, _LAYOUT_OPS) and cur.all_input_nodes:
                cur = cur.all_input_nodes[0]
            if cur in launch_anc and _is_call(cur, _GEMM_OPS):
                return cur
    return None


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _open_window(
    graph: fx.Graph, launch: fx.Node, attn: fx.Node, waits: list[fx.Node], after: Iterable[fx.Node] = ()
) -> list[fx.Node]:
    """Put ``launch`` right after the last of its inputs and of ``after`` (nodes it must follow: the readers of
    an older launch's output, see :func:`_inflight_bound`), and the Q-side nodes that precede it after it;
    returns the Q-side nodes moved, in order.

    Safe by construction: the nodes moved later are not ancestors of the launch or of ``after`` (nor is
    anything that uses them, which moves with them); the launch moves up only past nodes that are not its
    inputs, and down (past ``after``) only past nodes that do not use it, except its own getitems and waits,
    which move down with it (the caller checked that, :func:`_can_follow`).
    """
    after = list(after)
    launch_anc = _ancestors([launch, *after]) | set(after)
    q_side = {
        n for n in _ancestors([attn]) if n.op == "call_function" and n not in launch_anc and not _is_call(n, {_WAIT})
    }
    order = _order(graph)
    anchor = max([*launch.all_input_nodes, *after], key=order.__getitem__, default=None)
    if anchor is not None and order[anchor] > order[launch]:  # down, past `after`, with its getitems and waits
        own = [n for n in _descendants(launch) if order[n] < order[anchor]]
        cursor = anchor
        for n in [launch, *sorted(own, key=order.__getitem__)]:
            cursor.append(n)
            cursor = n
    moved, moved_set = [], set()
    for n in graph.nodes:
        if n is launch:
            break
        if n.op == "call_function" and (n in q_side or any(i in moved_set for i in n.all_input_nodes)):
            moved.append(n)
            moved_set.add(n)
    cursor = launch
    for n in moved:
        cursor.append(n)
        cursor = n
    order = _order(graph)
    last_input = max([*launch.all_input_nodes, *after], key=order.__getitem__, default=None)
    if last_input is not None and last_input.next is not launch:
        last_input.append(launch)
    return moved


def _descendants(n: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [n]
    while stack:
        for u in stack.pop().users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _can_follow(launch: fx.Node, node: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Can ``launch`` move down to right after ``node``? Only its getitems and waits may lie in between."""
    own = {launch, *(u for u in launch.users if _is_call(u, {operator.getitem}))}
    for d in _descendants(launch):
        if order[d] <= order[node] and not (_is_call(d, {operator.getitem, _WAIT}) and d.args[0] in own):
            return False
    return True


# ---- the in-flight bound: a launch reuses the pool slot of the launch `limit` before it (of its key) -------
# A pooling transport (the fast one) gives each (op, shape, dtype) key `limit` = inflight_limit() output slots,
# taken in turn: launch i of a key writes where launch i - limit wrote. So every reader of launch i - limit's
# output must run before launch i; the pass keeps that true for every launch it moves.
def _group_key(launch: fx.Node) -> tuple:
    """Launches with equal group keys may share a pool key: (op, dtype and shape of each tensor input); with a
    symbolic size anywhere, (op, dtypes and ranks) only, so sizes that may be equal at run time group together."""
    vals = [a.meta["val"] for a in launch.all_input_nodes]
    if all(isinstance(d, int) for v in vals for d in v.shape):
        return launch.target, tuple((v.dtype, tuple(v.shape)) for v in vals)
    return launch.target, tuple((v.dtype, v.dim()) for v in vals)


def _readers(launch: fx.Node) -> list[fx.Node]:
    """The nodes that read the launch's outputs (the first non-view users of its waits, the graph output
    included): until the last of them has run, the output's pool slot is taken."""
    return [u for w in _waits_of(launch) for u, _ in _first_compute_users(w)]


def _last_read(launch: fx.Node, order: dict[fx.Node, int]) -> int:
    """Position of the launch's last reader (end of graph when its output is never waited for)."""
    return max((order[r] for r in _readers(launch)), default=len(order))


def _fifo_broken(seq: list[tuple[float, int]], limit: int) -> list[int]:
    """Indices k in ``seq`` (``(position, last read)`` per launch, in launch order) where launch k runs before
    the last read of some launch j <= k - limit (the one whose slot it takes, or an earlier one)."""
    bad, last = [], float("-inf")
    for k, (pos, _) in enumerate(seq):
        if k >= limit:
            last = max(last, seq[k - limit][1])
            if last > pos:
                bad.append(k)
    return bad


def _inflight_bound(graph: fx.Graph, launch: fx.Node, limit: int) -> list[fx.Node] | None:
    """The nodes ``launch`` must follow so that it takes no pool slot whose output is still unread, and its
    place shifts no later launch of its key onto one: the readers of launch i - limit (i: its index among the
    launches of its key), and any later launch that would otherwise break. Returns [] when its earliest place
    (where it is) is fine; None when no place before its own readers is (a warning, or an error when STRICT).
    """
    order = _order(graph)
    key = _group_key(launch)
    others = sorted(
        (order[n], _last_read(n, order), n)
        for n in graph.nodes
        if n is not launch and _is_call(n, _LAUNCHES) and _group_key(n) == key
    )
    base = set(_fifo_broken([(p, e) for p, e, _ in others], limit))  # broken without it: not its doing
    mine = (None, _last_read(launch, order), launch)
    pos, after = float(order[launch]), []
    for _ in range(len(others) + 2):
        seq = sorted(others + [(pos,) + mine[1:]], key=lambda x: x[0])
        i = next(k for k, x in enumerate(seq) if x[2] is launch)
        bad = [k for k in _fifo_broken([(p, e) for p, e, _ in seq], limit) if k == i or (k > i and k - 1 not in base)]
        if not bad:
            return after
        if bad[0] == i:  # it would take the slot of an unread output: after the readers of launches <= i - limit
            olds = [x[2] for x in seq[: i - limit + 1] if x[1] > pos]
            new = [r for o in olds for r in _readers(o)]
        else:  # it would push a later launch onto an unread slot: stay after that launch
            new = [seq[bad[0]][2]]
        after.extend(n for n in new if n not in after)
        last = max(after, key=order.__getitem__)
        if order[last] >= mine[1] or not _can_follow(launch, last, order):
            return None
        pos = order[last] + 0.5
    return None


def check_inflight(graph: fx.Graph, limit: int | None = None) -> list[str]:
    """Launches in ``graph`` that would take the pool slot of a launch whose output is still unread (the
    launch ``limit`` before them of their key; default :func:`cp_ops.transport.base.inflight_limit`); one line
    each, [] when none."""
    limit = inflight_limit() if limit is None else limit
    if limit is None:
        return []
    order = _order(graph)
    groups: dict[tuple, list] = {}
    for n in graph.nodes:
        if _is_call(n, _LAUNCHES):
            groups.setdefault(_group_key(n), []).append(n)
    bad = []
    for seq in groups.values():
        for k in _fifo_broken([(order[n], _last_read(n, order)) for n in seq], limit):
            bad.append(f"{seq[k].name} runs before the output of {[n.name for n in seq[: k - limit + 1]]} is read "
                       f"({limit} slots per key)")
    return bad


def _sink_wait(wait: fx.Node, order: dict[fx.Node, int]) -> None:
    if wait.users:
        first = min(wait.users, key=order.__getitem__)
        if first is not wait.next:
            first.prepend(wait)


def _window_nodes(launch: fx.Node, waits: list[fx.Node], attn: fx.Node) -> list[fx.Node]:
    """Nodes strictly between the launch and its earliest wait that attention needs, the launch does not, and
    no wait precedes (e.g. not the unpacking of a Ulysses Q launch's buffer after its own wait)."""
    launch_anc = _ancestors([launch])
    attn_anc = _ancestors([attn])
    wait_set = set(waits)
    out, after_wait, n = [], set(), launch.next
    while n.op != "output" and n not in wait_set:
        if _is_call(n, {_WAIT}) or any(i in after_wait for i in n.all_input_nodes):
            after_wait.add(n)
        elif n.op == "call_function" and n in attn_anc and n not in launch_anc:
            out.append(n)
        n = n.next
    return out


def overlap_kv_communication(graph: fx.Graph) -> int:
    """Run the pass on a post-grad FX graph in place; returns the number of windows opened.

    No-op (returns 0) on graphs without cp_ops launches. Each window is logged at debug level on the
    ``cp_ops.passes`` logger with the nodes moved. A launch the pass fails on is left as it is, with a
    warning (the compile goes on without that window), unless :data:`STRICT` is set (tests set it).
    """
    launches = [n for n in graph.nodes if _is_call(n, _KV_LAUNCHES)]
    if not launches:
        return 0
    opened = 0
    for launch in launches:
        try:
            opened += _process_launch(graph, launch, opened)
        except Exception as e:  # noqa: BLE001 - an optimization must not break the user's compile
            if STRICT:
                raise
            log.warning("cp_ops.passes: no overlap window for %s: %s: %s", launch.name, type(e).__name__, e)
    graph.lint()
    bad = check_inflight(graph)
    if bad:
        if STRICT:
            raise RuntimeError("cp_ops overlap pass: in-flight bound broken: " + "; ".join(bad))
        log.warning("cp_ops.passes: in-flight bound broken (the fast transport will raise): %s", "; ".join(bad))
    return opened


def _process_launch(graph: fx.Graph, launch: fx.Node, wid: int) -> int:
    """Open window ``wid`` for one launch (after splitting a Ulysses [q, k, v] launch); returns 1 or 0."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    if isinstance(launch.args[0], (list, tuple)):  # a packing launch (Ulysses): split Q off
        if len(launch.args[0]) >= 2:
            split = _split_packed_launch(graph, launch, order)
            if split is None:
                return 0
            launch = split
            order = {n: i for i, n in enumerate(graph.nodes)}
        elif launch.meta.get(TAG):
            return 0  # the Q launch of an already split Ulysses launch
    waits = _waits_of(launch)
    attn = _find_attention(waits, order) if waits else None
    if attn is None:
        log.debug("cp_ops.passes: %s: no wait or no consumer after its wait; no window", launch.name)
        return 0
    moved = _open_window(graph, launch, attn, waits)
    limit = inflight_limit()
    after = _inflight_bound(graph, launch, limit) if limit is not None else []
    if after is None:
        msg = f"{launch.name}: more than {limit} launches of its key would be in flight, whatever its place"
        if STRICT:
            raise RuntimeError(f"cp_ops overlap pass: {msg}")
        log.warning("cp_ops.passes: %s", msg)
    elif after:
        moved = _open_window(graph, launch, attn, waits, after=after)
        launch.meta[AFTER] = [r.name for r in after]
        log.debug(
            "cp_ops.passes: window %d: %s placed after %s (%d pool slots per key: no launch takes an unread slot)",
            wid, launch.name, [r.name for r in after], limit,
        )
    order = _order(graph)
    for w in waits:
        _sink_wait(w, order)
        order = {n: i for i, n in enumerate(graph.nodes)}
    window = _window_nodes(launch, waits, attn)
    launch.meta[TAG] = (wid, "launch")
    for n in window:
        n.meta[TAG] = (wid, "q")
    for w in waits:
        w.meta[TAG] = (wid, "wait")
    fused = _fused_projection(set(window), _ancestors([launch]))
    if fused is not None:
        log.debug(
            "cp_ops.passes: window %d: fused projection %s feeds both K/V and Q: kept as one GEMM (splitting "
            "it changes the GEMM's shape and numerics); the window holds the Q-side work after it",
            wid, fused.name,
        )
    log.debug(
        "cp_ops.passes: window %d: %s(%s) → wait(s) %s before %s; moved after the launch: %s; in window: %s",
        wid, launch.name, ", ".join(a.name for a in launch.all_input_nodes), [w.name for w in waits],
        attn.name, [n.name for n in moved], [n.name for n in window],
    )
    return 1


# ---- step 4: pin the windows in Inductor's scheduler --------------------------------------------
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
                if STRICT:
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
    """:func:`_pin_windows`; on an error, a warning and the nodes unchanged in order (unless :data:`STRICT`)."""
    try:
        return _pin_windows(snodes)
    except Exception as e:  # noqa: BLE001 - an optimization must not break the user's compile
        if STRICT:
            raise
        log.warning("cp_ops.passes: windows not pinned in the scheduler: %s: %s", type(e).__name__, e)
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
