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
   Q's slot is the one that reaches the attention op's ``query`` argument (through views and copies, and the ``cat``
   that keeps an uneven shard's real rows: :meth:`cp_ops.layout.Shards.ulysses_rows` reads each slot by ``select``
   when traced, so uneven Ulysses gets its window too). Traced code packs the send buffer itself
   (:meth:`cp_ops.comm.OpComm.ulysses`: ``ulysses_packed_start(stack([q, k, v], 3))``, a stack Inductor lowers into
   the norm/RoPE kernels): ``_split_packed_send`` splits the stack the same way, into a K/V stack and launch and a
   Q stack and launch.
2. ``_open_window``: the Q side of a window is every node the attention depends on and the launch does
   not. Q-side nodes before the launch (and anything that uses them) move to after it, keeping their order;
   then the launch rises to right after its last input (K after its norm and RoPE, V after its projection),
   never past another collective (nor does a Q-side collective move down past it): the ranks must issue their
   collectives in one order, and their graphs may differ where the order is free (uneven shards: only the padding
   ranks pad).
3. ``_sink_wait``: each wait moves to right before its first user.
4. The window's nodes are tagged (``node.meta``); :func:`cp_ops.passes.pin.pin_windows`, a scheduler pass, then
   adds ordering dependencies launch → Q-side kernels → wait, so that Inductor's own reordering (fusion, e.g. Q
   RoPE with K RoPE; ``reorder_for_peak_memory``) keeps the Q kernels inside the window in the generated code.

All or nothing: each launch's rewrite starts from a snapshot of the graph (:mod:`cp_ops.passes.rollback`); when
one fails partway the graph is put back as it was before that launch (that launch keeps its place, a warning
says why). At the end :func:`check_inflight` checks the pool-slot bound (below); when the pass broke it for any
launch, the whole graph is put back as traced (no window) with a warning. :data:`STRICT` turns both into
errors (tests set it).

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

from .rollback import GraphSnapshot

log = logging.getLogger("cp_ops.passes")

aten = torch.ops.aten
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_KV_LAUNCHES = frozenset(KV_LAUNCH_OPS)  # the pass opens a window from each (cp_ops.ops's ops table)
_LAUNCHES = frozenset(LAUNCH_OPS)  # every launch: all count towards the in-flight bound
AFTER = "cp_ops_after"  # node.meta key of a launch placed after another's consumption: (token, consumer nodes)
TAG = "cp_ops_window"  # node.meta key: (window id, role) with role in {"launch", "q", "wait"}
STRICT = False  # True: a failure inside the pass (or of its final check) raises instead of undoing it with a warning
#: the meta keys the pass writes on nodes it did not create (``val``: a rewired select's; the tags): what its
#: snapshots keep (:class:`~cp_ops.passes.rollback.GraphSnapshot`; the nodes it creates are erased on a restore)
_META_KEYS = ("val", TAG, AFTER)

# Ops that only re-view or copy a tensor (or join copies of its rows): followed through when looking for the op that
# consumes it.
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
    aten.cat.default,  # the real rows of an uneven Ulysses slot, traced (cp_ops.layout.Shards.rows: a cat of slices)
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


def _kv_q_slots(launch: fx.Node, n: int):
    """How a Ulysses launch of ``n`` slots splits: ``(wait, selects, kv, q)`` — its one wait, the
    ``select(buf, 3, slot)`` views that read it, the K/V slots and the query slots — or None (reason logged) when the
    buffer is used other than through one wait and such views, or the query slots cannot be told apart."""
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
    if not q_slots or len(q_slots) == n:
        log.debug("cp_ops.passes: %s kept whole: cannot tell the query slot (found %s)", launch.name, q_slots)
        return None
    return wait, selects, [i for i in range(n) if i not in q_slots], sorted(q_slots)


def _rewire(graph: fx.Graph, wait: fx.Node, selects: list[fx.Node], *launches) -> None:
    """Give each ``(slots, launch)`` of ``launches`` its own wait where ``wait`` was, and point every
    ``select(buf, 3, slot)`` of ``selects`` at the wait of the launch now carrying its slot."""
    with graph.inserting_before(wait):
        waits = [(slots, _new_call(graph, _WAIT, (launch,), wait)) for slots, launch in launches]
    for sel in selects:
        slot = sel.args[2]
        slots, src = next((sl, w) for sl, w in waits if slot in sl)
        sel.args = (src, 3, slots.index(slot))
        sel.meta["val"] = _fake_val(sel.target, sel.args)


def _split_packed_launch(
    graph: fx.Graph, launch: fx.Node, order: dict[fx.Node, int], dead: list[fx.Node]
) -> fx.Node | None:
    """Rewrite a packing launch (``ulysses_start([..q..k..v..])``: its first argument a list) into a K/V launch plus a Q launch; returns the K/V launch.

    The packing launch and its wait, left without users, are appended to ``dead``: the caller erases them once
    the whole pass has succeeded (until then a :class:`GraphSnapshot` can still put them back in use).
    Returns None (graph unchanged, reason logged) when the buffer is used other than through one wait and
    ``select(buf, 3, slot)`` views, or the query slot cannot be told from the attention op.
    """
    xs, *rest = launch.args  # (world_size, group_name, transport[, call, tag, seq_lens])
    if len(xs) < 2:
        return None
    slots = _kv_q_slots(launch, len(xs))
    if slots is None:
        return None
    wait, selects, kv, q = slots
    with graph.inserting_before(launch):
        launch_kv, launch_q = _launch_pair(graph, launch, [xs[i] for i in kv], [xs[i] for i in q], rest)
    _rewire(graph, wait, selects, (kv, launch_kv), (q, launch_q))
    dead.extend((wait, launch))
    log.debug("cp_ops.passes: split %s into %s (slots %s: K/V) and %s (slots %s: Q)", launch.name, launch_kv.name, kv,
              launch_q.name, q)
    return launch_kv


_PACKED = torch.ops.cp_ops.ulysses_packed_start.default
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _send_parts(send: fx.Node) -> list[fx.Node] | None:
    """The per-tensor parts a traced Ulysses send buffer ``[W, B, S, n, hs, D]`` was stacked from
    (:func:`cp_ops.layout.ulysses_pack_traced`'s ``stack(parts, 3)``), in slot order, in any of the forms it reaches
    the post-grad graph: ``stack(parts, 3)`` or ``view(cat(parts, 3))`` (parts ``[W, B, S, hs, D]``), or
    ``cat(parts, 3)`` (parts ``[W, B, S, 1, hs, D]``: stack decomposed through unsqueeze); None otherwise."""
    shape = tuple(send.meta["val"].shape)
    if len(shape) != 6:
        return None
    five, six = (*shape[:3], *shape[4:]), (*shape[:3], 1, *shape[4:])
    if _is_call(send, {aten.stack.default}):
        parts, dim, want = send.args[0], send.args[1] if len(send.args) > 1 else 0, five
        ok_dim = dim in (3, -3)
    elif _is_call(send, {aten.cat.default}):
        parts, dim, want = send.args[0], send.args[1] if len(send.args) > 1 else 0, six
        ok_dim = dim in (3, -3)
    elif _is_call(send, _VIEWS) and isinstance(send.args[0], fx.Node) and _is_call(send.args[0], {aten.cat.default}):
        cat = send.args[0]
        parts, dim, want = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0, five
        ok_dim = dim in (3, -2) and len(cat.users) == 1
    else:
        return None
    if not ok_dim or len(parts) != shape[3] or any(tuple(p.meta["val"].shape) != want for p in parts):
        return None
    return list(parts)


#: what the K/V launch of a split call adds to the call's name in its rank-contract exchange
SPLIT_NOTE = ("[K/V and Q sent apart by cp_ops.compile's overlap pass: every rank must run this call compiled with "
              "the pass, or none]")


def _split_call(rest: list, launch: fx.Node) -> list:
    """The launch arguments after the buffer (``world_size, group_name, transport[, call, ...]``) for the K/V launch
    of a split call: its call name marked (:data:`SPLIT_NOTE`), so its rank-contract exchange differs from a peer
    that sends the call's buffer whole (eager, or compiled without the pass): every rank raises, naming both,
    instead of all-to-alls of different sizes (gloo aborts the process, NCCL hangs or reads wrong bytes). A later
    launch ('-': no exchange) stays one."""
    rest = list(rest)
    call = rest[3] if len(rest) > 3 else ""
    if call == "-":
        return rest
    name = f"{call or str(launch.target).split('.')[0].replace('cp_ops.', 'cp_ops::')} {SPLIT_NOTE}"
    return rest[:3] + [name] + rest[4:]


def _launch_pair(graph: fx.Graph, launch: fx.Node, kv_arg, q_arg, rest: list) -> tuple[fx.Node, fx.Node]:
    """The two launches that replace ``launch`` (inserted where the caller's ``inserting_before`` says): of ``kv_arg``
    and of ``q_arg`` (their tensors or send buffers), ``rest`` = the launch's arguments after its first. The K/V launch
    keeps the call's rank-contract arguments, its name marked split (:func:`_split_call`; it runs first: the exchange
    is made there); the Q launch is a later launch of the same call (``'-'``: no exchange)."""
    return (_new_call(graph, launch.target, (kv_arg, *_split_call(rest, launch)), launch),
            _new_call(graph, launch.target, (q_arg, *rest[:3], "-", *rest[4:]), launch))


def _split_packed_send(
    graph: fx.Graph, launch: fx.Node, order: dict[fx.Node, int], dead: list[fx.Node]
) -> fx.Node | None:
    """:func:`_split_packed_launch` for a launch of a send buffer packed by traced code (``ulysses_packed_start(
    stack([q, k, v], 3))``, :meth:`cp_ops.comm.OpComm.ulysses`): two stacks of the same parts, K/V and Q, each with
    its launch (the K/V one keeps the call's rank-contract arguments, Q's is a later launch, ``'-'``); returns the K/V
    launch, or None (graph unchanged) as :func:`_split_packed_launch`. Inductor then writes each new send buffer
    from the kernels producing its parts, as it wrote the one it replaces."""
    send, *rest = launch.args
    parts = _send_parts(send)
    if parts is None or len(parts) < 2:
        return None
    if len(send.users) != 1 or len(rest) < 4:
        log.debug("cp_ops.passes: %s kept whole: its send buffer has other users, or no call arguments", launch.name)
        return None
    slots = _kv_q_slots(launch, len(parts))
    if slots is None:
        return None
    wait, selects, kv, q = slots
    with graph.inserting_before(launch):
        sends = []
        for idx in (kv, q):
            sub = [parts[i] for i in idx]
            if _is_call(send, {aten.stack.default, aten.cat.default}):
                sends.append(_new_call(graph, send.target, (sub, 3), send))
            else:  # view(cat(parts, 3), [W, B, S, n, hs, D]) with n = len(sub) (the other sizes as traced)
                cat = _new_call(graph, aten.cat.default, (sub, 3), send.args[0])
                shape = list(send.args[1])
                shape[3] = len(sub)
                sends.append(_new_call(graph, send.target, (cat, shape), send))
        launch_kv, launch_q = _launch_pair(graph, launch, sends[0], sends[1], rest)
    _rewire(graph, wait, selects, (kv, launch_kv), (q, launch_q))
    dead.extend((wait, launch, send))
    if isinstance(send.args[0], fx.Node) and _is_call(send.args[0], {aten.cat.default}):
        dead.append(send.args[0])  # the stack's cat (view(cat(parts)) as decomposed)
    log.debug("cp_ops.passes: split %s into %s (slots %s: K/V) and %s (slots %s: Q)", launch.name, launch_kv.name, kv,
              launch_q.name, q)
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


def _is_collective(n: fx.Node) -> bool:
    """A launch of cp_ops (:data:`_LAUNCHES`) or a c10d functional collective (not its wait)."""
    return n.op == "call_function" and (
        n.target in _LAUNCHES or (getattr(n.target, "namespace", "") == "_c10d_functional" and n.target is not _WAIT))


def _collectives_before(graph: fx.Graph, launch: fx.Node) -> list[fx.Node]:
    out = []
    for n in graph.nodes:
        if n is launch:
            return out
        if _is_collective(n):
            out.append(n)
    return out


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
    # every collective before the launch stays before it (the launch rises past none, and none moves down past it;
    # a launch moved down past `after`, the in-flight bound, still may pass one): the ranks must issue their
    # collectives in one order, and their graphs may differ where the order is free (uneven shards: only the ranks
    # that pad have the padding's nodes), so an order chosen from the graph's
    # dependencies differed between ranks (pipelined Ulysses, uneven, key mask: rank 0 sent sub-group 1's K/V while
    # rank 1 sent sub-group 0's Q: gloo "Received data size doesn't match expected size")
    after = list(after) + _collectives_before(graph, launch)
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
    symbolic size anywhere, (op, dtypes and ranks) only, so sizes that may be equal at run time group together. Only
    tensor inputs count: a launch's int arguments may be graph nodes too (``seq_lens`` under ``dynamic=True``: SymInts),
    and the pool key is the output's shape and dtype."""
    skip = _ordering_input(launch)
    vals = [v for v in (a.meta["val"] for a in launch.all_input_nodes if a is not skip) if isinstance(v, torch.Tensor)]
    if all(isinstance(d, int) for v in vals for d in v.shape):
        return launch.target, tuple((v.dtype, tuple(v.shape)) for v in vals)
    # a packed Ulysses send buffer [W, B, S, n, hs, D]: its slot count n is a constant, and buffers of different n
    # never share a pool key (K/V and Q after a split, and the launch they replace)
    slots = (_slot_count(launch),) if launch.target is _PACKED else ()
    return launch.target, tuple((v.dtype, v.dim()) for v in vals), slots


def _arg(node: fx.Node, name: str, default=None):
    """The argument ``name`` of an op call node (by keyword, or at its position in the op's schema), else
    ``default`` (not given, or the op has no such argument)."""
    if name in node.kwargs:
        return node.kwargs[name]
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else default
    return default


def _ordering_input(launch: fx.Node):
    """The node passed as the launch's ``after`` (the Ulysses launches' ordering input, never read: pipelined Ulysses
    orders a launch after what read the output its pool slot held), or None: not data, so not in its pool key."""
    a = _arg(launch, "after")
    return a if isinstance(a, fx.Node) else None


def _slot_count(launch: fx.Node):
    """The tensor count n of a packed Ulysses launch: its send buffer's ``shape[3]`` where that is an int, else its
    ``count`` argument. Under ``dynamic=True`` a traced send buffer's sizes may be symbolic expressions (e.g. ``[W, B,
    S, 3*hs, hs, D//hs]``), which a key cannot hash (TypeError: unhashable type: non-nested SymInt); the
    launch as traced carries its count (the call's tensor count; the K/V and Q launches of a split keep the call's
    count but get buffers built here, whose ``shape[3]`` is an int)."""
    n = launch.args[0].meta["val"].shape[3]
    if isinstance(n, int):
        return n
    count = _arg(launch, "count", 0)
    return count if isinstance(count, int) and count > 0 else str(n)


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
    (where it is) is fine; None when no place before its own readers is (the launch then gets no window).
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
    return [line for _, line in _broken_inflight(graph, limit)]


def _broken_inflight(graph: fx.Graph, limit: int | None = None, skip: Iterable[fx.Node] = ()) -> list[tuple[str, str]]:
    """(launch name, line) for each launch :func:`check_inflight` reports; launches in ``skip`` (replaced ones,
    not yet erased) left out."""
    limit = inflight_limit() if limit is None else limit
    if limit is None:
        return []
    skip = set(skip)
    order = _order(graph)
    groups: dict[tuple, list] = {}
    for n in graph.nodes:
        if _is_call(n, _LAUNCHES) and n not in skip:
            groups.setdefault(_group_key(n), []).append(n)
    bad = []
    for seq in groups.values():
        for k in _fifo_broken([(order[n], _last_read(n, order)) for n in seq], limit):
            bad.append((seq[k].name, f"{seq[k].name} runs before the output of {[n.name for n in seq[: k - limit + 1]]} "
                                     f"is read ({limit} slots per key)"))
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
    ``cp_ops.passes`` logger with the nodes moved. All or nothing (see the module docs): a launch the pass fails
    on keeps its place and the graph is as before that launch, with a warning (the compile goes on without that
    window); a result that breaks the in-flight bound where the traced graph did not is undone whole (the graph
    as traced, 0 returned), with a warning. With :data:`STRICT` set (tests) both raise ``RuntimeError`` instead,
    after the graph is restored.

    A launch that, already as traced, takes the pool slot of an output not yet read is reported with a warning
    and left as it is: on a pooling transport (fast) that output would be overwritten before it is read, and the
    runtime does not detect it (its guard tracks waits, not reads).
    """
    launches = [n for n in graph.nodes if _is_call(n, _KV_LAUNCHES)]
    if not launches:
        return 0
    traced = GraphSnapshot(graph, _META_KEYS)
    broken_as_traced = dict(_broken_inflight(graph))
    dead: list[fx.Node] = []  # launches and waits replaced by a split: erased once the pass has succeeded
    opened = 0
    for launch in launches:
        before, n_dead = GraphSnapshot(graph, _META_KEYS), len(dead)
        try:
            opened += _process_launch(graph, launch, opened, dead)
        except Exception as e:  # noqa: BLE001 - an optimization must not break the user's compile
            before.restore()
            del dead[n_dead:]
            if STRICT:
                raise
            log.warning("cp_ops.passes: no overlap window for %s: %s: %s (its rewrite undone: it keeps its place)",
                        launch.name, type(e).__name__, e)
    broken = [line for name, line in _broken_inflight(graph, skip=dead) if name not in broken_as_traced]
    if broken:
        traced.restore()
        msg = ("the rewritten graph would let a launch take the pool slot of an output not yet read, which the "
               "traced graph did not: " + "; ".join(broken))
        if STRICT:
            raise RuntimeError(f"cp_ops overlap pass: {msg}")
        log.warning("cp_ops.passes: overlap pass undone, the graph runs as traced (no overlap): %s", msg)
        return 0
    for n in dead:  # each wait before its launch: users first
        graph.erase_node(n)
    graph.lint()
    if broken_as_traced:
        log.warning(
            "cp_ops.passes: as traced, %s: on a pooling transport (fast) such an output is overwritten before it is "
            "read, which the runtime does not detect (it tracks waits, not reads)", "; ".join(broken_as_traced.values()),
        )
    return opened


class _NoWindow(RuntimeError):
    """No safe place for a launch's window: its rewrite is undone (see :func:`overlap_kv_communication`)."""


def _process_launch(graph: fx.Graph, launch: fx.Node, wid: int, dead: list[fx.Node]) -> int:
    """Open window ``wid`` for one launch (after splitting a Ulysses [q, k, v] launch); returns 1 or 0.
    Raises when the launch has no place that keeps the in-flight bound (the caller undoes the rewrite)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    if launch.meta.get(TAG):
        return 0  # inside an earlier launch's window: the Q launch of a Ulysses call (split here, or traced so)
    packing = isinstance(launch.args[0], (list, tuple)) and len(launch.args[0]) >= 2
    packed = launch.target is _PACKED and _slot_count(launch) != 1
    if packing or packed:  # a Ulysses launch of several tensors: split Q off
        split = (_split_packed_launch if packing else _split_packed_send)(graph, launch, order, dead)
        if split is None:
            return 0
        launch = split
        order = {n: i for i, n in enumerate(graph.nodes)}
    waits = _waits_of(launch)
    attn = _find_attention(waits, order) if waits else None
    if attn is None:
        log.debug("cp_ops.passes: %s: no wait or no consumer after its wait; no window", launch.name)
        return 0
    moved = _open_window(graph, launch, attn, waits)
    limit = inflight_limit()
    after = _inflight_bound(graph, launch, limit) if limit is not None else []
    if after is None:
        raise _NoWindow(
            f"cp_ops overlap pass: {launch.name}: more than {limit} launches of its key would be in flight, "
            "whatever its place"
        )
    if after:
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
