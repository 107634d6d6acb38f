"""The cross-rank call contract: every rank of a CP group makes the same cp_ops calls, in the same order, with the
same local shape, dtype, transport argument, collective settings (:data:`cp_ops.config.COLLECTIVE_FIELDS`) and
variant (:func:`variant_tag`) — else an error on every rank, naming what each rank called, before any data moves.

Every call makes one exchange all ranks make (a rank alone cannot decide to skip it): a fixed-size int64 signature
(text as 64-bit BLAKE2b digests) all-gathered through host shared memory on one host, else over a gloo side group; a
second exchange, only on a difference, carries each rank's description for the message. Host code: under CUDA graphs
it runs at capture. Faults, waits, bounds: ``docs/faults.md``; ``settings.check_ranks``: ``docs/settings.md``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import logging
import operator
import pickle
import re
import struct
import sys
import threading
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from . import config
from ._peers import Peers, PeerExited
from ._waits import PeerWait, PeersTimeout, poll
from .group import backend_name
from .validate import dtype_name

log = logging.getLogger("cp_ops")

#: Every call that exchanges a signature: name -> id (a stable hash, equal on every rank).
OPS: dict[str, int] = {}
# signature fields (int64 each): what they are called in messages
_FIELDS = ("call", "group", "call #", "failed", "transport", "settings", "B", "S_local", "H", "D", "dtype", "tensors",
           "checksum0", "checksum1", "checksum2", "chunks", "tag")
_N = len(_FIELDS)
_PACK = struct.Struct(f"<{_N}q")
# the aspect a difference in each field is named by (None: not named; tag: the variant, named by its note)
_ASPECT = ("call", "call", "call number", None, "transport", "settings", "shape", "shape", "shape", "shape", "dtype",
           "count", "inputs", "inputs", "inputs", "chunks", "variant")
_ids: dict = {}  # str/dtype/settings tuple -> stable int id
_collective_values = operator.attrgetter(*config.COLLECTIVE_FIELDS)  # == settings.collective_values(), faster


def _digest(text: str) -> int:
    """A stable nonzero signed 64-bit BLAKE2b digest of ``text`` (a collision: probability 2**-64)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True) or 1


def _id(key) -> int:
    v = _ids.get(key)
    if v is None:
        v = _ids[key] = _digest(repr(key))
    return v


def register_op(name: str) -> int:
    OPS[name] = _id(name)
    return OPS[name]


# ---- per-group state -----------------------------------------------------------------------------
class _Group:
    """Per CP group: peers, side group and shared memory (made at the first exchange), call count, signature
    buffers; ``broken``: why the group cannot be used any more."""

    __slots__ = ("pg", "w", "gid", "skip", "side", "shm", "peers", "broken", "count", "agreed", "lbuf", "gbuf",
                 "local", "gathered")

    def __init__(self, pg: dist.ProcessGroup):
        self.pg, self.w, self.gid = pg, pg.size(), _id(pg.group_name)
        self.skip = self.w == 1 or backend_name(pg) == "fake"
        self.side, self.shm, self.peers, self.broken, self.count, self.agreed = None, None, None, None, 0, 0
        self.lbuf, self.gbuf = bytearray(8 * _N), bytearray(8 * _N * self.w)
        self.local = torch.frombuffer(self.lbuf, dtype=torch.int64)
        self.gathered = torch.frombuffer(self.gbuf, dtype=torch.int64)

    def release(self, why: str | None = None) -> None:
        """Drop the side group and unmap the shared memory; ``why``: every later exchange raises it."""
        self.side = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if why is not None:
            self.broken = why


_groups: dict[str, _Group] = {}


def _release_all() -> None:
    """At exit, drop the side groups and shared-memory maps while the interpreter is whole (a gloo group left to the
    final teardown can abort the process)."""
    for st in _groups.values():
        st.release()
    _groups.clear()
    import gc

    gc.collect()


atexit.register(_release_all)


def _live_groups():
    """The process groups torch still knows (a dict keyed by group), or None where this torch does not say."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return getattr(world, "pg_names", None)


#: Called with each destroyed group cp_ops notices (see :func:`on_group_destroyed`).
_on_destroyed: list[Callable[[dist.ProcessGroup], None]] = []


def on_group_destroyed(fn: Callable[[dist.ProcessGroup], None]) -> None:
    """Call ``fn(group)`` when cp_ops notices that ``group`` was destroyed (at the first exchange on a new group)."""
    _on_destroyed.append(fn)


def drop_destroyed(cache: dict, at: int) -> None:
    """Delete the entries of ``cache`` (keys: tuples with a process group at index ``at``; torch reuses a destroyed
    group's name) whose group torch no longer knows."""
    live = _live_groups()
    if live is None:
        return
    for key in [k for k in cache if k[at] not in live]:
        del cache[key]


def _forget_destroyed() -> None:
    """Release the state of every group that was destroyed (``dist.destroy_process_group``)."""
    live = _live_groups()
    if live is None:
        return
    for name, st in list(_groups.items()):
        if st.pg not in live:
            st.release(f"CP group '{name}' was destroyed (torch.distributed.destroy_process_group)")
            del _groups[name]
            for fn in _on_destroyed:
                fn(st.pg)


def _state(pg: dist.ProcessGroup) -> _Group:
    st = _groups.get(pg.group_name)
    if st is None or st.pg is not pg:  # a new group of that name (after destroy/init): start over
        if st is not None:
            st.release(f"CP group '{pg.group_name}' was replaced by a new group of that name")
        _forget_destroyed()  # a new group: the moment to release what destroyed ones held
        st = _groups[pg.group_name] = _Group(pg)
    return st


def call_count(group: dist.ProcessGroup) -> int:
    """How many rank-checked cp_ops calls this rank has made on ``group`` (0 before the first)."""
    st = _groups.get(group.group_name)
    return st.count if st is not None and st.pg is group else 0


def announce(group: dist.ProcessGroup) -> None:
    """Publish this rank's process identity for ``group`` now (one store write), so a peer waiting for it later can
    tell that it exited; a rank's first exchange on a group does it anyway."""
    st = _state(group)
    if st.skip:
        return
    if st.peers is None:
        st.peers = Peers(group)
    st.peers.announce()


def agree(group: dist.ProcessGroup, key: str, value: str, what: str) -> list[str]:
    """Every rank's ``value`` (a short str), in group-rank order, through the default store: a rare per-group
    decision (e.g. ``transport='auto'``'s), made by every rank in the same order with the same ``key`` (the n-th
    meets at ``agree/<n>/<key>``; a failed one is retried at the same n). One rank or 'fake' backend: ``[value] * W``.

    Raises:
        RuntimeError: not every rank reached it within ``settings.timeout_s``, or a peer on this host exited (named).
    """
    st = _state(group)
    if st.skip:
        return [value] * st.w
    if st.peers is None:
        st.peers = Peers(group)
    wait = PeerWait(_call_words(st, None, st.count + 1), f"the ranks' agreement on {what}",
                    "calling again waits for them again")
    try:
        out = st.peers.gather(f"agree/{st.agreed}/{key}", value, wait)
    except PeerExited as e:
        raise RuntimeError(f"{wait.call}: {e} while this rank waited for it in {wait.stage}") from e
    st.agreed += 1
    return out


# ---- the call a wait is in, in the user's words --------------------------------------------------
class _Current(threading.local):
    group = api = None  # the group name and API name of the public call in progress (api_checked)
    label = None  # waiting_in(...): the words for the call, replacing '<op> call #n'


_current = _Current()


@contextlib.contextmanager
def waiting_in(label: str):
    """``with waiting_in("cp_ops.parallelize inputs of forward #3"):`` waits inside name the call so (warnings and
    timeout errors) instead of ``<op> call #n``. Nests."""
    prev, _current.label = _current.label, label
    try:
        yield
    finally:
        _current.label = prev


def _call_words(st: "_Group", op: str | None, n: int) -> str:
    """The call a wait on ``st``'s peers is in: ``"cp_ops.attention call #3 on CP group '0'"``; ``op`` None: the
    public call in progress on this group (default ``cp_ops.attention``, whose first call makes the agreements)."""
    g = st.pg.group_name
    if _current.label is not None:
        return f"{_current.label} on CP group '{g}'"
    if op is None:
        op = _current.api if _current.group == g and _current.api else "cp_ops.attention"
    return f"{op} call #{n} on CP group '{g}'"


#: Exchange through host shared memory when every rank of the group is on one host (else over gloo).
_USE_SHM = True


def _setup(st: _Group, op: str) -> None:
    """The group's first exchange: meet the peers (store), make the gloo side group and (one host) the shm exchange."""
    if st.broken:
        raise RuntimeError(st.broken)
    pg, timeout = st.pg, config.settings.timeout_s
    if st.peers is None:
        st.peers = Peers(pg)
    peers = st.peers
    where = f"CP group '{pg.group_name}' (ranks {peers.global_ranks})"
    wait = PeerWait(_call_words(st, op, st.count + 1), "the first-call rendezvous (each rank's first cp_ops call on "
                    "this group)", "calling again waits for them again")
    try:
        ids = peers.gather("ready", peers.me.encode(), wait)
    except PeerExited as e:
        st.broken = f"{op}: {where}: {e}; the group cannot be used by cp_ops any more"
        raise RuntimeError(st.broken) from e
    # PeersTimeout: nothing made yet: calling again waits for the peers again, at the same keys
    from torch.distributed.distributed_c10d import _get_default_store

    from ._peers import Identity

    peers.ids = [Identity.decode(s) for s in ids]
    try:
        store = dist.PrefixStore(f"{peers.base}side/", _get_default_store())
        st.side = dist.ProcessGroupGloo(store, pg.rank(), st.w, datetime.timedelta(seconds=timeout))
        if _USE_SHM:
            st.shm = _make_shm(st, op)
    except RuntimeError as e:
        gone = peers.exited(range(st.w))
        why = peers.said(gone) if gone else _line(e)
        st.release(f"{op}: setting up the rank contract of {where} failed after every rank had arrived (a peer died, "
                   f"or one that had timed out earlier did not call again): {why}; the group cannot be used by cp_ops "
                   "any more")
        raise RuntimeError(st.broken) from e


def _make_shm(st: _Group, op: str):
    """The shared-memory exchange of a group on one host (None: over gloo), agreed through the store. Rank 0 makes
    the file and removes its name once every rank mapped it, or on any error."""
    from ._shm_exchange import ShmExchange

    peers, call = st.peers, _call_words(st, op, st.count + 1)
    if len({i.node for i in peers.ids}) != 1:  # not one node (cp_ops.node: CP_OPS_NODE_ID or the host name)
        return None
    rank, x = st.pg.rank(), None
    try:
        made = ""
        if rank == 0:
            try:
                x = ShmExchange.create(st.w, _N)
                made = "path:" + x.path
            except OSError as e:  # e.g. /dev/shm full: exchange over gloo
                made = "error:" + str(e)
        made = peers.gather("shm/file", made, PeerWait(call, "the rank check's shared-memory setup"))[0]
        if not made.startswith("path:"):
            return _over_gloo(st, f"rank 0 could not make the file: {made[6:]}")
        err = ""
        if rank != 0:
            try:
                x = ShmExchange.attach(made[5:], st.w, rank, _N)
            except OSError as e:  # e.g. another container's /dev/shm under the same host name
                err = str(e)
        errs = peers.gather("shm/mapped", err, PeerWait(call, "the rank check's shared-memory setup (mapping the file)"))
    except BaseException:
        if x is not None:
            if rank == 0:
                x.unlink()
            x.close()
        raise
    if rank == 0:
        x.unlink()  # every rank has it mapped (or gave up): the name is no longer needed
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        if x is not None:
            x.close()
        return _over_gloo(st, "; ".join(f"rank {r}: {e}" for r, e in bad))
    return x


def _over_gloo(st: _Group, why: str) -> None:
    log.warning("cp_ops: CP group '%s': the rank contract exchanges over gloo (~0.5 ms per call) instead of host "
                "shared memory: %s", st.pg.group_name, why)


# ---- the exchange --------------------------------------------------------------------------------
def _exchanges(st: _Group) -> bool:
    """Whether a call on ``st``'s group exchanges its signature: not on one rank or a 'fake' backend (``skip``), nor
    after the first call with ``check_ranks='off'``."""
    return not (st.skip or (st.count and config.settings.check_ranks == "off"))


def _signed(st: _Group, op: str, op_id: int, tid: int, b, s, h, d, dt: int, extra: int, s0: int, s1: int, s2: int,
            chunks: int, tag: int, failed: bool) -> bool:
    """Pack this call's words into ``st.lbuf`` and all-gather. True when every rank's signature equals this rank's.
    Its callers skip it where no exchange is made (:func:`_exchanges` False)."""
    if st.side is None:
        _setup(st, op)
    st.count += 1
    _PACK.pack_into(st.lbuf, 0, op_id, st.gid, st.count, failed, tid, _id(_collective_values(config.settings)),
                    b, s, h, d, dt, extra, s0, s1, s2, chunks, tag)
    return _gather(st, op)


class Like(NamedTuple):
    """The ``[B, S_local, H, D]`` shape and dtype an exchange compares, for a call holding no such tensor (a packed
    Ulysses send buffer: ``Like((B, S_local, W * H/W, D), dtype)``); cheaper than a meta tensor per call."""
    shape: tuple
    dtype: torch.dtype


def exchange(pg: dist.ProcessGroup, op: str, transport: str, t=None, extra: int = 0,
             failed: BaseException | None = None, inputs: dict | None = None, tag: int = 0,
             note: str | None = None) -> None:
    """Check the rank contract for one call: all ranks of ``pg`` exchange a signature; raise on every rank on any
    difference. ``op``: the call's name; ``t``: the ``[B, S_local, H, D]`` tensor (or :class:`Like`) compared, or
    None; ``extra``: the tensor count; ``failed``: this rank's own input error (peers learn that it stops; the caller
    re-raises it); ``inputs``: name -> tensor (at most 3) whose checksums must agree; ``tag``, ``note``: the variant.

    Raises:
        ValueError: on every rank (but a rank that passed ``failed``), naming each rank's call and what differs.
        RuntimeError: the ranks did not all reach the exchange within ``settings.timeout_s``, or a peer exited.
    """
    st = _groups.get(pg.group_name)
    if st is None or st.pg is not pg:
        st = _state(pg)
    if not _exchanges(st):
        return
    sums = (0, 0, 0)
    if inputs is not None:
        b, s, h, d, dtype = _id(tuple(None if x is None else (tuple(x.shape), x.dtype) for x in inputs.values())), \
            -1, -1, -1, 0
        sums = (tuple(input_checksum(x) for x in inputs.values()) + sums)[:3]
    elif isinstance(t, (torch.Tensor, Like)) and len(t.shape) == 4:
        b, s, h, d = t.shape
        dtype = _id(t.dtype)
    else:
        b = s = h = d = -1
        dtype = 0
    if not _signed(st, op, OPS.get(op) or register_op(op), _id(transport), b, s, h, d, dtype, extra, *sums, 0, tag,
                   failed is not None):
        t_ok = isinstance(t, (torch.Tensor, Like))
        _disagree(st, op, transport, list(t.shape) if t_ok else None,
                  dtype_name(t.dtype) if t_ok else None, extra, failed, inputs, 0, note)


def _gather(st: _Group, op: str) -> bool:
    """All-gather the signature in ``st.lbuf`` (a bounded wait); True when every rank's equals this rank's."""
    mine = bytes(st.lbuf)
    try:
        if st.shm is not None:
            if not st.shm.allgather(st.count, mine, st.gbuf):  # (True: every peer's row was there: no wait)
                _wait_shm(st, op)
        else:
            _wait_work(st, st.side._allgather_base(st.gathered, st.local), _waiting(st, op))
    except PeersTimeout as e:
        # the exchange left posted would pair with a late peer's earlier call: later calls raise at once
        st.release(f"{_call_words(st, op, st.count)} timed out in its rank check; the group cannot be used by cp_ops "
                   f"any more (make a new group): {_line(e)}")
        raise
    except RuntimeError as e:
        g = st.pg.group_name
        gone = _within_grace(lambda: st.peers.exited(range(st.w))) if st.peers is not None else []
        if gone:
            who = st.peers.said(gone)
            st.release(f"{op}: CP group '{g}': {who}; the group cannot be used by cp_ops any more")
            raise RuntimeError(f"{op}: call #{st.count} on CP group '{g}': {who} while this rank waited for it in the "
                               "rank check") from e
        raise RuntimeError(f"{_call_words(st, op, st.count)}: this call's rank check failed: {_line(e)}. A peer on "
                           "another host may have crashed (its log says why)") from e
    return st.gbuf == mine * st.w


def _waiting(st: _Group, op: str) -> Callable[[], PeerWait]:
    """The rank check's :class:`PeerWait` of this call, made at its first use."""
    wait = None

    def waiting() -> PeerWait:
        nonlocal wait
        if wait is None:
            wait = PeerWait(_call_words(st, op, st.count), "this call's rank check (the exchange of each rank's call)",
                            "this rank's exchange stays posted, so a later call would pair with a peer's earlier one: "
                            "the group cannot be used by cp_ops any more (make a new group)")
        return wait

    return waiting


def _wait_shm(st: _Group, op: str) -> None:
    """The shared-memory exchange's wait for the peers' rows (after its first read found some missing): bounded,
    the peers' liveness checked and the warnings given as it waits."""
    waiting = _waiting(st, op)

    def on_wait(pending):
        st.peers.check_alive(pending)
        waiting().tick(lambda: st.peers.names(pending))

    if not st.shm.wait(st.count, st.gbuf, config.settings.timeout_s, on_wait):
        raise waiting().error(st.peers.names(st.shm.pending))


def _wait_work(st: _Group, work, waiting: Callable[[], PeerWait]) -> None:
    """Wait for the gloo exchange ``work``. Gloo does not say who arrived: after a second this rank publishes its
    call number (``at/<rank>``), so warnings name the ranks not seen."""
    at = None

    def check() -> bool:
        nonlocal at
        w = waiting()
        if at is None and w.waited() >= min(1.0, w.warn_s / 2):
            at = st.peers.store
            at.set(f"{st.peers.base}at/{st.pg.rank()}", str(st.count))
        if at is not None:
            w.tick(lambda: _not_seen(st))
            if w.expired():
                raise w.error(_not_seen(st))
        return False

    poll(work.is_completed, check)
    work.wait()  # raises the exchange's error, if it failed


def _not_seen(st: _Group) -> str:
    """The ranks not seen at this call (the gloo exchange, :func:`_wait_work`), in words."""
    p, out = st.peers, []
    for r in range(st.w):
        if r == st.pg.rank():
            continue
        key = f"{p.base}at/{r}"
        seen = p.store.get(key).decode() if p.store.check([key]) else None
        if seen != str(st.count):
            out.append(r)
    return (p.names(out) + " (not seen at this call)") if out else "a rank (which one is not known over gloo)"


def call_failed(group: dist.ProcessGroup | str) -> None:
    """This rank's call on ``group`` raised between its launches (the comm's drain calls it): publish the failure
    for the peers waiting in its collectives (:class:`BoundedWork` names it). One store write."""
    name = group if isinstance(group, str) else group.group_name
    st = _groups.get(name)
    if st is None or st.peers is None or st.skip:
        return
    e = sys.exc_info()[1]
    why = f"{type(e).__name__}: {_line(e)[:300]}" if e is not None else "an error"
    try:
        st.peers.store.set(f"{st.peers.base}failed/{st.pg.rank()}", f"{st.count}\t{why}")
    except Exception:  # noqa: BLE001 - the body's error is the one raised
        pass


def _failed_peers(st: _Group) -> list[tuple[int, str]]:
    """(rank, its error) of each peer that published a failure of this call (:func:`call_failed`)."""
    p, out = st.peers, []
    for r in range(st.w):
        key = f"{p.base}failed/{r}"
        if r != st.pg.rank() and p.store.check([key]):
            n, why = p.store.get(key).decode().split("\t", 1)
            if n == str(st.count):
                out.append((r, why))
    return out


#: Seconds a failed collective or exchange looks for the peer that exited before giving its own error.
_GRACE_S = 1.0


def _within_grace(look: Callable):
    """``look()`` until it returns something or :data:`_GRACE_S` passed (an exited peer closes its sockets a moment
    before its process shows as ended)."""
    t_end = time.monotonic() + _GRACE_S
    while not (found := look()) and time.monotonic() < t_end:
        time.sleep(0.05)
    return found


class BoundedWork:
    """``work``, a data collective of this rank's call on ``pg`` run on the host (gloo), whose ``wait()`` is bounded
    by cp_ops: an exited peer or one that published a failure (:func:`call_failed`) is named; every such error leaves
    the group unusable for cp_ops (its collectives are out of step). A group without a set-up contract: ``work.wait()``.
    ``wait()`` raises RuntimeError naming the failing or exited peer and the call; PeersTimeout at
    ``settings.timeout_s``. The ops wrap it to register it (:func:`cp_ops.ops._register`)."""

    __slots__ = ("pg", "work")

    def __init__(self, pg: dist.ProcessGroup, work):
        self.pg, self.work = pg, work

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - Work's signature
        work, pg = self.work, self.pg
        if work is None:
            return True
        self.work = None
        st = _groups.get(pg.group_name)
        if st is None or st.pg is not pg or st.peers is None or st.skip:
            work.wait()
            return True
        try:
            if not work.is_completed():  # (done already: no poll)
                poll(work.is_completed, _collective_check(st))
            work.wait()
        except PeersTimeout as e:
            st.release(_line(e) + ": the group cannot be used by cp_ops any more: make a new group")
            raise
        except RuntimeError as e:
            if getattr(e, "_cp_ops_named", False):
                raise
            _within_grace(lambda e=e: _peer_trouble(st, e))  # the collective failed (a connection reset): names the peer
            call = _call_words(st, None, st.count)
            st.release(f"{call}: its communication failed; the group cannot be used by cp_ops any more: make a new "
                       "group")
            raise RuntimeError(f"{call}: this call's communication failed: {_line(e)}. A peer on another host may have "
                               "crashed (its log says why); the group cannot be used by cp_ops any more: make a new "
                               "group") from e
        return True


def _collective_check(st: _Group):
    """:meth:`BoundedWork.wait`'s check of the peers while it polls (:func:`cp_ops._waits.poll`)."""
    wait = None

    def check() -> bool:
        nonlocal wait
        if wait is None:
            wait = PeerWait(_call_words(st, None, st.count), "this call's communication (a collective of its data)",
                            "the group cannot be used by cp_ops any more: make a new group")
            return False
        _peer_trouble(st, None)
        wait.tick("a rank (its part of this collective has not come)")
        if wait.expired():
            raise wait.error("a rank (its part of this collective)")
        return False

    return check


def _peer_trouble(st: _Group, cause: BaseException | None) -> None:
    """Raise (RuntimeError, and mark the group unusable) when a peer exited or published a failure of this call;
    ``cause``: the collective's own error, if it failed."""
    gone = st.peers.exited(range(st.w))
    failed = _failed_peers(st)
    if not gone and not failed:
        return
    call = _call_words(st, None, st.count)
    what = "; ".join(([st.peers.said(gone)] if gone else []) + [f"{st.peers.name(r)} raised {w}" for r, w in failed])
    err = RuntimeError(f"{call}: {what} during this call's communication: this rank stops too. Fix that rank's "
                       "error (its log has it); the group cannot be used by cp_ops any more: make a new group")
    err._cp_ops_named = True  # type: ignore[attr-defined]
    st.release(_line(err))
    raise err from cause


class CallCheck:
    """:func:`exchange` for one repeated call (the eager plan's), its words computed once; ``check()`` exchanges and
    raises as :func:`exchange` (``chunks``: pipeline stages, 0: not pipelined)."""

    __slots__ = ("pg", "st", "op", "transport", "shape", "dtype", "extra", "chunks", "tag", "words", "note")

    def __init__(self, pg: dist.ProcessGroup, op: str, transport: str, shape, dtype: torch.dtype, extra: int,
                 chunks: int = 0, tag: int = 0, note: str | None = None):
        self.pg, self.st, self.op, self.transport = pg, _state(pg), op, transport
        self.shape, self.dtype, self.extra, self.chunks, self.tag, self.note = \
            tuple(shape), dtype, extra, chunks, tag, note
        b, s, h, d = shape
        self.words = (OPS.get(op) or register_op(op), _id(transport), b, s, h, d, _id(dtype))

    def check(self) -> None:
        st = self.st
        if not _exchanges(st):
            return
        op_id, tid, b, s, h, d, dt = self.words
        if not _signed(st, self.op, op_id, tid, b, s, h, d, dt, self.extra, 0, 0, 0, self.chunks, self.tag, False):
            _disagree(self.st, self.op, self.transport, list(self.shape), dtype_name(self.dtype),
                      self.extra, None, None, self.chunks, self.note)


def _line(e: BaseException) -> str:
    """The first line of ``e``'s message ('' for an exception raised without one, e.g. ``KeyboardInterrupt()``)."""
    return (str(e).splitlines() or [""])[0]


# ---- the error on every rank ---------------------------------------------------------------------
def _disagree(st: _Group, op, transport, shape, dtype, extra, failed, inputs, chunks, note=None) -> None:
    """Every rank gets here together: exchange descriptions, then raise on every rank — except on a rank whose own
    checks failed (its caller raises its own error)."""
    rows = [_PACK.unpack_from(st.gbuf, i * 8 * _N) for i in range(st.w)]
    mine = {
        "call": op, "n": st.count, "transport": transport,
        "settings": dict(zip(config.COLLECTIVE_FIELDS, config.settings.collective_values())),
        "shape": shape, "dtype": dtype, "tensors": extra, "chunks": chunks,
        "inputs": None if inputs is None else {k: (None if x is None else (list(x.shape), str(x.dtype)))
                                               for k, x in inputs.items()},
        "error": None if failed is None else f"{type(failed).__name__}: {_line(failed)}",
        "note": note,
    }
    desc = _gather_objects(st, mine)
    if failed is not None:
        return
    g = st.pg.group_name
    bad = [i for i, r in enumerate(rows) if r[3]]
    if bad:
        errors = "; ".join(f"rank {i}: {desc[i]['call']}: {desc[i]['error']}" for i in bad)
        raise ValueError(
            f"{op}: rank(s) {bad} of CP group '{g}' rejected their inputs ({errors}); this rank stops too, so no "
            "rank waits in a collective"
        )
    aspects = []
    for j in range(_N):
        if any(r[j] != rows[0][j] for r in rows) and _ASPECT[j] and _ASPECT[j] not in aspects:
            aspects.append(_ASPECT[j])
    per_rank = "; ".join(f"rank {i}: {_describe(d, aspects, desc)}" for i, d in enumerate(desc))
    hints = [h for h in (_uneven_hint(aspects, desc), *_variant_hints(aspects, desc), _inputs_hint(rows, desc)) if h]
    # one line first: what differs and what to do (the first hint, else the rule); each rank's call after it
    todo = (_inputs_hint(rows, desc, short=True) or (hints[0] if hints else ""))[2:] or \
        "every rank must make the same cp_ops calls in the same order, with the same arguments"
    raise ValueError(
        f"{_call_words(st, op, st.count)}: the ranks differ in {', '.join(aspects)}: {todo}\n"
        f"  {op}: the ranks of CP group '{g}' must make the same cp_ops calls in the same order; they differ in "
        f"{', '.join(aspects)}: {per_rank}{''.join(hints)}"
    )


def _inputs_hint(rows: list, desc: list[dict], short: bool = False) -> str:
    """Each compared input that differs (:func:`check_inputs_agree`): its name, shape and dtype, and which ranks
    hold the same (shape, dtype, checksum). ``short``: only the names and what differs (the first line)."""
    if any(d["inputs"] is None or d["call"] != desc[0]["call"] for d in desc):
        return ""
    parts = []
    for i in range(min(3, len(desc[0]["inputs"]))):
        seen = [list(d["inputs"].items())[i] if len(d["inputs"]) > i else ("?", None) for d in desc]
        groups: dict = {}
        for r, ((_, meta), row) in enumerate(zip(seen, rows)):
            groups.setdefault((repr(meta), row[12 + i]), []).append(r)
        if len(groups) == 1:
            continue
        what = "values (checksums)" if len({repr(m) for _, m in seen}) == 1 else "shapes or dtypes"
        names = sorted({n for n, _ in seen})
        held = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
                         f"{_shape_dtype(seen[rs[0]][1])}"
                         for rs in groups.values())
        parts.append(f"input {' / '.join(names)} differs in {what}" + ("" if short else f" ({held})"))
    if not parts:
        return ""
    return "; " + "; ".join(parts) + ": pass the same tensors on every rank (seed the latents and noise alike)"


def _shape_dtype(meta) -> str:
    return "no tensor" if meta is None else f"shape {meta[0]} {str(meta[1]).replace('torch.', '')}"


def _uneven_hint(aspects: list[str], desc: list[dict]) -> str:
    """Where the ranks differ only in S_local (uneven shards without ``seq_lens``): the ``seq_lens`` to pass."""
    shapes = [d["shape"] for d in desc]
    if aspects != ["shape"] or any(s is None or len(s) != 4 for s in shapes) or len(
            {(s[0], s[2], s[3]) for s in shapes}) != 1:
        return ""
    return (f"; only S_local differs: for uneven shards pass seq_lens={tuple(s[1] for s in shapes)} (the same tuple "
            "on every rank: the token count each rank holds, as you cut them; cp_ops.layout.shard(x, 1, rank, W) cuts the "
            "standard split, whose counts are cp_ops.layout.shard_sizes(total, W))")


def _variant_hints(aspects: list[str], desc: list[dict]) -> list[str]:
    """Where the ranks' variants differ: in the caller's ``tag=`` only (a skipped or reordered layer), in mode and
    chunks, in the softmax scale."""
    if "variant" not in aspects:
        return []
    notes, out = [d.get("note") or "" for d in desc], []
    if len({re.sub(r" ?tag=\S+", "", n) for n in notes}) == 1 and len(set(notes)) > 1:
        out.append("; the ranks are at different tagged calls (layers): a rank skipped a layer's attention or ran the "
                   "layers in another order — every rank must make every CP attention call")
    elif len({tuple(re.findall(r"\b(?:mode|chunks)=\S+", n)) for n in notes}) > 1:
        out.append("; the ranks started different CP variants at the same call: cp_ops.attention (and parallelize) "
                   "must get the same mode and chunks on every rank")
    scales = [(re.findall(r"\bscale=(\S+)", n) or ["None"])[-1] for n in notes]  # the last field
    if len(set(scales)) > 1:
        out.append("; the ranks passed different softmax scales (" + ", ".join(f"rank {i}: scale={s}" for i, s in
                                                                               enumerate(scales))
                   + "): cp_ops.attention's scale must be the same on every rank (None = 1/sqrt(D) on every rank)")
    return out


def _describe(d: dict, aspects: list[str], everyone: list[dict]) -> str:
    out = f"{d['call']} (call #{d['n']})"
    if d["shape"] is not None:
        out += f" [B, S_local, H, D]={d['shape']} dtype={d['dtype']} tensors={d['tensors']}"
    elif d["tensors"]:
        out += f" count={d['tensors']}"
    if d["inputs"] is not None:
        out += f" inputs={d['inputs']}"
    if d.get("note"):
        out += f" {d['note']}"
    if "chunks" in aspects:
        out += f" chunks={d.get('chunks') or 'none (not pipelined)'}"
    if "transport" in aspects:
        out += f" transport={d['transport']!r}"
    if "settings" in aspects:
        differ = [f for f in config.COLLECTIVE_FIELDS if any(e["settings"][f] != d["settings"][f] for e in everyone)]
        out += " " + " ".join(f"{f}={d['settings'][f]!r}" for f in differ)
    if "inputs" in aspects:
        out += " (input checksums differ: the ranks were given different inputs; seed them alike)"
    return out


def _gather_objects(st: _Group, obj) -> list:
    """All-gather one picklable object per rank over the side group (only on the error path)."""
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = torch.empty(st.w, dtype=torch.int64)
    st.side._allgather_base(sizes, size).wait()
    n = int(sizes.max())
    buf = torch.zeros(n, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(st.w * n, dtype=torch.uint8)
    st.side._allgather_base(out, buf).wait()
    return [pickle.loads(bytes(out[i * n: i * n + int(sizes[i])].tolist())) for i in range(st.w)]


# ---- checks built on the exchange ----------------------------------------------------------------
def input_checksum(t) -> int:
    """A cheap fingerprint of ``t``'s values: 61 strided samples, index-weighted, summed in fp64 (its bits as an
    int); a GPU tensor costs one tiny sync."""
    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    flat = t.detach().reshape(-1)
    s = flat[:: max(1, flat.numel() // 61)].double()
    w = torch.arange(1, s.numel() + 1, dtype=torch.float64, device=s.device)
    return struct.unpack("<q", struct.pack("<d", float((s * w).sum())))[0]


def check_inputs_agree(group: dist.ProcessGroup, what: str, inputs: dict) -> None:
    """Raise ValueError on every rank (naming the inputs that differ) unless ``inputs`` (name -> tensor or None, at
    most 3) have the same shapes, dtypes and checksums on every rank of ``group`` (replicated inputs: latents, ...)."""
    if len(inputs) > 3:
        raise ValueError(f"check_inputs_agree compares at most 3 inputs; got {len(inputs)}")
    exchange(group, what, "", inputs=inputs)


def check_settings_agree(group: dist.ProcessGroup) -> None:
    """Compare the collective settings (:data:`cp_ops.config.COLLECTIVE_FIELDS`) across the ranks of ``group`` now
    (every call's exchange does too): ValueError on every rank, naming each differing setting and each rank's value."""
    exchange(group, "cp_ops.check_settings_agree", "")


def api_checked(group: dist.ProcessGroup, api: str, checks: Callable[[], None]) -> None:
    """Run a public function's input checks; if they fail, tell the peers before raising (while ``torch.compile``
    traces: the checks only). Waits on peers until the next exchange on ``group`` name the call ``api``."""
    _current.group, _current.api = group.group_name, api
    try:
        checks()
    except (ValueError, RuntimeError, TypeError) as e:
        if not torch.compiler.is_compiling():
            exchange(group, api, "", failed=e)
        raise


def op_checked(group: dist.ProcessGroup, op: str, transport: str, t, rules: Callable[[], None], extra: int = 0, *,
               call: str = "", tag: int = 0, seq_lens=None) -> None:
    """An op's real kernel: its input rules, then the exchange, named ``call`` (empty: the op's name) with the variant
    ``tag`` (``seq_lens`` folded in); ``call`` '-' (a later launch of a call): the rules only."""
    if call == "-":
        rules()
        return
    partner = _partners.get((group.group_name, tag))
    tag = with_seq_lens(tag, seq_lens)
    name, note = call or op, tag_note(tag)
    try:
        rules()
    except (ValueError, RuntimeError, TypeError) as e:
        exchange(group, name, transport, None, extra, failed=e, tag=tag, note=note)
        _tell_partner(partner, name, e)
        raise
    try:
        exchange(group, name, transport, t, extra, tag=tag, note=note)
    except (ValueError, RuntimeError) as e:
        _tell_partner(partner, name, e)
        raise


#: (group name, variant tag) of a 2-D call's first (inner) exchange -> the group of its second (outer), told by
#: :func:`op_checked` when the first fails
_partners: dict[tuple[str, int], str] = {}


def set_partner(first: str, tag: int, second: str) -> int:
    """Declare that a compiled 2-D call with variant ``tag`` exchanges on ``first``, then on ``second``: when the
    first fails, the rank tells ``second`` (else that exchange would pair with its next call). Returns ``tag``. Run by
    Dynamo while tracing (a constant result: a side effect in a graph would apply only after the graph ran)."""
    _partners[(first, tag)] = second
    return tag


set_partner._dynamo_marked_constant = True  # type: ignore[attr-defined] - torch._dynamo's assume_constant_result


def _tell_partner(partner: str | None, name: str, e: BaseException) -> None:
    if partner is None or isinstance(e, PeersTimeout):  # a late peer: the partner's ranks time out alone, a retry meets
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        exchange(_resolve_process_group(partner), name, "", failed=e)
    except Exception:  # noqa: BLE001 - the first exchange's error is the one raised
        pass


# ---- the variant tag: what a call's signature carries beyond shapes (mode, chunks, shards, the caller's tag) ----
_TAG_NOTES: dict[int, str] = {}


def variant_tag(**fields) -> int:
    """A stable 64-bit int for the rank contract's ``tag`` word, its fields kept in words for messages
    (:func:`tag_note`); None values left out. Values: ints, strings or tuples of them, else TypeError."""
    parts = []
    for k, v in fields.items():
        if v is None:
            continue
        if not _stable(v):
            raise TypeError(f"{k} must be an int, a str, or a tuple of them (the same on every rank); got "
                            f"{type(v).__name__} {v!r}")
        parts.append(f"{k}={list(v) if isinstance(v, tuple) else v}")
    note = " ".join(parts)
    t = _digest(note)
    _TAG_NOTES[t] = note
    return t


def scale_field(scale) -> str | None:
    """The variant field of a softmax ``scale``: None for ``None``, else ``repr(float(scale))``. TypeError for a
    scale that is not a real number (a bool, a str, a tensor)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be None (1/sqrt(D)) or a real number (a Python float or int, the same on every "
                        f"rank); got {type(scale).__name__} {scale!r}")
    # through float.hex: Dynamo specializes a symbolic float on it (one graph per scale); repr() of one is a break
    return repr(float.fromhex((scale if isinstance(scale, float) else float(scale)).hex()))


def _stable(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_stable(x) for x in v)
    return isinstance(v, (int, str))


def with_seq_lens(tag: int, seq_lens) -> int:
    """``tag`` with a call's uneven token counts folded in (by the ops at run time; by the eager path once per plan)."""
    if seq_lens is None:
        return tag
    seq = [int(n) for n in seq_lens]
    key = (tag, tuple(seq))
    got = _SEQ_TAGS.get(key)
    if got is None:
        base = _TAG_NOTES.get(tag, "")
        note = f"{base} seq_lens={seq}".strip()
        got = _SEQ_TAGS[key] = _digest(note)
        _TAG_NOTES[got] = note
    return got


_SEQ_TAGS: dict = {}


def tag_note(tag: int) -> str | None:
    return _TAG_NOTES.get(tag)


# a constant for the compiler: called while torch.compile traces (the dispatcher's decisions), with constant arguments
variant_tag._dynamo_marked_constant = True  # type: ignore[attr-defined]
