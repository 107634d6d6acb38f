"""A Python model of the fast transport's flag protocol (csrc/cp_fast.cu), run under random device schedules.

Each rank has CUDA-like streams (FIFO queues of ops; an op runs when its condition holds) and the control
words of the protocol. The host program (launches and waits, in order) is enqueued up front; then a random
scheduler runs any enabled stream head of any rank until all ops ran (or none can run: a hang).

Two protocols:
  * ``'epoch'`` — the old one: ``e = ++counter`` per call; ``ready[p] := e``, ``arrived[p] := e`` overwritten
    (one flag per peer); a wait passes when ``arrived[p] >= e``.
  * ``'slot'`` — the current one: a call owns slot ``s`` (round-robin over ``n_slots``; the host never reuses
    a slot before its call was waited); its begin waits for the slot's previous wait (done event), raises
    ``gen[s]``, writes ``ready[s][me] := gen[s]`` on every peer, then spins on the current stream until every
    peer's ``ready[s][t] >= gen[s]`` (the rendezvous); the send streams wait for the rendezvous only, copy, and
    raise ``arrived[s][me] := gen[s]`` on the target; a wait passes when ``arrived[s][p] >= gen[s]``.

A wait that passes before every source's data of its call landed is a *stale* result; ops left with none
enabled is a *hang*. ``send_stream(call, target)`` is the tuned decision: which send stream carries the copy
and the arrival signal of ``call`` to ``target``.
"""

from __future__ import annotations

import random
from collections import deque


class Violation(Exception):
    pass


def run(world: int, program: list, send_stream, protocol: str, n_slots: int = 4, seed: int = 0,
        cur_stream=lambda call: "cur", slot_of=None, n_bufs=0) -> None:
    """Run ``program`` (list of ("launch", call) / ("wait", call), the same on every rank) once under the
    random schedule ``seed``. Raises :class:`Violation` ('stale ...' or 'hang ...').

    ``slot_of`` (slot protocol): a dict call -> slot, the slots of CUDA-graph replays (each replay of a captured
    call reuses the captured slot; the begin then has no done-event dependency, as in ``Lane.launch`` while
    capturing: the order comes from the stream). A kernel reads ``gen[s]`` when it runs (as the CUDA kernels
    do), and a wait joins the call's own send streams (``Lane.wait``). ``n_bufs`` > 0: call c writes every
    rank's pool buffer ``c % n_bufs``; a copy into a buffer whose previous call the target did not read yet (its
    wait, then the read, on the call's current stream) is a *clobber* (what the ready flags prevent)."""
    rng = random.Random(seed)
    ranks = [_Rank(r, world, n_bufs) for r in range(world)]
    for rk in ranks:
        rk.enqueue(program, ranks, send_stream, protocol, n_slots, cur_stream, slot_of)
    while True:
        enabled = [(rk, q) for rk in ranks for q in rk.streams.values() if q and q[0][0]()]
        if not enabled:
            left = {rk.rank: {n: len(q) for n, q in rk.streams.items() if q} for rk in ranks}
            if any(left.values()):
                raise Violation(f"hang: ops left with none enabled: {left}")
            return
        rk, q = rng.choice(enabled)
        _, act = q.popleft()
        act()


class _Rank:
    def __init__(self, rank, world, n_bufs=0):
        self.rank, self.world, self.n_bufs = rank, world, n_bufs
        self.streams: dict[str, deque] = {}
        self.counter = 0
        self.gen: dict = {}
        self.ready: dict = {}
        self.arrived: dict = {}
        self.data: set = set()  # (call, src) landed here
        self.done: set = set()  # ids of completed ops (event records)
        self.epoch: dict = {}  # call -> its epoch/generation on this rank (read by its kernels)

    def q(self, name):
        return self.streams.setdefault(name, deque())

    def enqueue(self, program, ranks, send_stream, protocol, n_slots, cur_stream, fixed=None):
        me, w = self.rank, self.world
        slot_of, owner, last_wait = {}, {}, {}
        nxt = 0
        prev_same_buf, holder, waited = {}, {}, set()  # the pool: call c writes buffer c % n_bufs (of every rank)
        always = lambda: True  # noqa: E731
        for kind, c in program:
            if kind == "launch":
                if protocol == "slot":
                    if fixed is not None:  # a replayed graph: the captured slot, no done-event dependency
                        s = fixed[c]
                    else:
                        s = nxt
                        nxt = (nxt + 1) % n_slots
                    if owner.get(s) is not None:
                        raise Violation(f"host: slot {s} still holds un-waited call {owner[s]} (launch {c} refused)")
                    owner[s], slot_of[c] = c, s
                if self.n_bufs:
                    if not isinstance(c, int):
                        raise ValueError("n_bufs > 0 needs integer call ids")
                    b = c % self.n_bufs
                    old = holder.get(b)
                    if old is not None and old not in waited:  # Pool.get refuses to overwrite an un-waited output
                        raise Violation(f"host: buffer {b} still holds un-waited call {old} (launch {c} refused)")
                    prev_same_buf[c], holder[b] = old, c
                cur = self.q(cur_stream(c))
                if protocol == "slot" and fixed is None and s in last_wait:
                    dep = last_wait[s]
                    cur.append((lambda dep=dep: dep in self.done, always))

                def begin(c=c):
                    if protocol == "slot":
                        s = slot_of[c]
                        g = self.gen.get(s, 0) + 1
                        self.gen[s] = g
                        self.epoch[c] = g
                        for p in ranks:
                            if p.rank != me:
                                p.ready[(s, me)] = g
                    else:
                        self.counter += 1
                        self.epoch[c] = self.counter
                        for p in ranks:
                            if p.rank != me:
                                p.ready[me] = self.counter
                    self.done.add(("begin", c))

                cur.append((always, begin))
                if protocol == "slot":  # the begin kernel then spins until every peer's ready[s][t] >= g
                    def ready_all(c=c):
                        return all(self.ready.get((slot_of[c], t), 0) >= self.epoch[c] for t in range(w) if t != me)

                    def rendezvous(c=c):
                        self.done.add(("rendezvous", c))

                    cur.append((ready_all, rendezvous))
                for t in range(w):
                    if t == me:
                        continue
                    sq = self.q(f"send{send_stream(c, t)}")
                    if protocol == "slot":  # the send streams wait for the rendezvous (an event): no spin of their own
                        sq.append((lambda c=c: ("rendezvous", c) in self.done, always))
                    else:
                        sq.append((lambda c=c: ("begin", c) in self.done, always))
                        sq.append((lambda c=c, t=t: self.ready.get(t, 0) >= self.epoch[c], always))

                    def copy(c=c, t=t):
                        old = prev_same_buf.get(c)  # the buffer's previous call: read on t already?
                        if self.n_bufs and old is not None and ("read", old) not in ranks[t].done:
                            raise Violation(f"clobber: rank {me} wrote call {c} into rank {t}'s buffer before rank "
                                            f"{t} read call {old} from it")
                        ranks[t].data.add((c, me))

                    def signal(c=c, t=t):  # signal_kernel stores *gen as it runs (slot protocol)
                        if protocol == "slot":
                            ranks[t].arrived[(slot_of[c], me)] = self.gen[slot_of[c]]
                        else:
                            ranks[t].arrived[me] = self.epoch[c]
                        self.done.add(("sent", c, t))

                    sq.append((always, copy))
                    sq.append((always, signal))
            else:  # wait, on the current stream of the call
                cur = self.q(cur_stream(c))
                cur.append((lambda c=c: ("begin", c) in self.done, always))

                def arrived_all(c=c):  # wait_all_kernel reads *gen as it runs (slot protocol)
                    if protocol == "slot":
                        g = self.gen[slot_of[c]]
                        return all(self.arrived.get((slot_of[c], p), 0) >= g for p in range(w) if p != me)
                    return all(self.arrived.get(p, 0) >= self.epoch[c] for p in range(w) if p != me)

                def check(c=c):
                    missing = [p for p in range(w) if p != me and (c, p) not in self.data]
                    if missing:
                        raise Violation(f"stale: rank {me}'s wait for call {c} passed before the data of ranks "
                                        f"{missing} landed")
                    self.done.add(("read", c))  # the consumer's read, stream-ordered after the wait

                def joined(c=c):  # the wait joins the call's own send streams (Lane.wait), then records done
                    return all(("sent", c, t) in self.done for t in range(w) if t != me)

                waited.add(c)
                cur.append((arrived_all, check))
                cur.append((joined, lambda c=c: self.done.add(("wait", c))))
                if protocol == "slot":
                    s = slot_of[c]
                    owner[s] = None
                    last_wait[s] = ("wait", c)


def explore(world, program, send_stream, protocol, seeds=200, **kw) -> list[str]:
    """Violations found over ``seeds`` random schedules (deduplicated by kind)."""
    found = []
    for seed in range(seeds):
        try:
            run(world, program, send_stream, protocol, seed=seed, **kw)
        except Violation as e:
            found.append(str(e).split(":")[0])
    return sorted(set(found))
