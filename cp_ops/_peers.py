"""The peers of a CP group: who they are, whether their processes still run, and a bounded all-gather of short
strings through the default store (keys under ``cp_ops/contract/<group name>/``) — the rendezvous under
:mod:`cp_ops.contract`. Each rank's **identity** (``id/<rank>``: host, pid namespace, pid, start time) tells whether
a peer on this host has *exited* (no such pid, a zombie, or its pid reused); peers on other hosts are not watched.
:meth:`Peers.gather`'s keys are fixed per purpose, so a rank that timed out and calls again meets a late peer there.
"""

from __future__ import annotations

import os
import socket
import time
from typing import NamedTuple

import torch.distributed as dist

from . import config
from ._waits import CHECK_EVERY_S, PeerWait, PeersTimeout  # noqa: F401 - PeersTimeout: what gather raises

_PREFIX = "cp_ops/contract/"


class PeerExited(RuntimeError):
    """A peer this rank waits for has exited (same host; seen in ``/proc``)."""


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks) of process ``pid``; None: no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return ("?", "")  # exists, unreadable: alive as far as we know
    rest = data[data.rindex(b")") + 2:].split()  # fields 3.. (the name, field 2, may hold spaces)
    return rest[0].decode(), rest[19].decode()  # field 3: state; field 22: start time


def node_id() -> str:
    """This rank's node identity (:mod:`cp_ops.node`): ``CP_OPS_NODE_ID`` if set, else the host name."""
    return config.settings.node_id or socket.gethostname()


class Identity(NamedTuple):
    """Where a rank's process runs (enough to tell, on the same host, whether it still runs) and its node."""

    host: str
    pidns: str  # '' when unknown (no /proc): not watched
    pid: int
    start: str  # process start time (clock ticks since boot), '' when unknown
    node: str = ""

    def encode(self) -> str:
        return f"{self.host}\t{self.pidns}\t{self.pid}\t{self.start}\t{self.node}"

    @classmethod
    def decode(cls, s: str) -> "Identity":
        host, ns, pid, start, node = s.split("\t")
        return cls(host, ns, int(pid), start, node)


def identity() -> Identity:
    """This process's :class:`Identity`."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    st = _proc_stat(os.getpid()) if ns else None
    return Identity(socket.gethostname(), ns, os.getpid(), st[1] if st else "", node_id())


def exited(peer: Identity, me: Identity) -> str | None:
    """How ``peer``'s process is known to have ended, or None (it runs, or it cannot be watched from here: another
    host or pid namespace, no ``/proc``)."""
    if not peer.pidns or peer.host != me.host or peer.pidns != me.pidns:
        return None
    st = _proc_stat(peer.pid)
    if st is None:
        return "exited"
    if st[0] in ("Z", "X", "x"):
        return "exited (a zombie, not yet reaped by its parent)"
    if peer.start and st[1] and st[1] != peer.start:
        return "exited (its pid now belongs to a newer process)"
    return None


class Peers:
    """The rendezvous of one CP group ``pg``; blocking calls are bounded by their ``PeerWait``."""

    def __init__(self, pg: dist.ProcessGroup):
        from torch.distributed.distributed_c10d import _get_default_store

        self.pg, self.rank, self.w = pg, pg.rank(), pg.size()
        self.global_ranks = dist.get_process_group_ranks(pg)
        self.base = f"{_PREFIX}{pg.group_name}/"
        self.store = _get_default_store()
        self.me = identity()
        self.ids: list[Identity | None] = [None] * self.w
        self.ids[self.rank] = self.me
        self.announced = False

    def announce(self) -> None:
        """Publish this rank's identity for the group (once; one store write, no wait)."""
        if not self.announced:
            self.store.set(f"{self.base}id/{self.rank}", self.me.encode())
            self.announced = True

    def _identity(self, r: int) -> Identity | None:
        ident = self.ids[r]
        if ident is None:
            key = f"{self.base}id/{r}"
            if self.store.check([key]):
                ident = self.ids[r] = Identity.decode(self.store.get(key).decode())
        return ident

    def exited(self, ranks) -> list[tuple[int, str]]:
        """(rank, how) for each of ``ranks`` (group ranks) known to have exited."""
        out = []
        for r in ranks:
            ident = self._identity(r)
            why = exited(ident, self.me) if ident is not None else None
            if why is not None:
                out.append((r, why))
        return out

    def name(self, r: int) -> str:
        """'rank r' with its global rank and pid when known, for messages."""
        ident = self.ids[r]
        where = f", pid {ident.pid} on {ident.host}" if ident is not None else ""
        return f"rank {r} (global rank {self.global_ranks[r]}{where})"

    def check_alive(self, ranks) -> None:
        """Raise :class:`PeerExited` naming each of ``ranks`` whose process has exited."""
        gone = self.exited(ranks)
        if gone:
            raise PeerExited(self.said(gone))

    def said(self, gone) -> str:
        """``(rank, how)`` pairs (:meth:`exited`) in words: 'rank 1 (...) exited ...', joined."""
        return "; ".join(f"{self.name(r)} {how}" for r, how in gone)

    def names(self, ranks) -> str:
        """``ranks`` (group ranks) in words, for messages: 'rank 1 (global rank 1, pid ... on host)', joined."""
        return ", ".join(self.name(r) for r in ranks)

    def gather(self, key: str, value: str, wait: PeerWait) -> list[str]:
        """Every rank's ``value`` for ``key``, in group-rank order; every :data:`CHECK_EVERY_S` s the peers waited for
        are checked alive and ``wait`` warns. Raises PeerExited (a peer exited) or PeersTimeout (named)."""
        self.announce()
        keys = [f"{self.base}{key}/{r}" for r in range(self.w)]
        self.store.set(keys[self.rank], value)
        pending = [r for r in range(self.w) if r != self.rank]
        t0 = time.monotonic()
        next_check, pause = t0 + CHECK_EVERY_S, 0.0005
        while True:
            pending = [r for r in pending if not self.store.check([keys[r]])]
            if not pending:
                break
            now = time.monotonic()
            if now >= next_check:
                self.check_alive(pending)
                wait.tick(lambda: self.names(pending))
                next_check = now + CHECK_EVERY_S
            if wait.expired():
                raise wait.error(self.names(pending))
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return [self.store.get(k).decode() if r != self.rank else value for r, k in enumerate(keys)]
