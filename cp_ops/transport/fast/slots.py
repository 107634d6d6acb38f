"""The fast lane's call slots: each launched call owns one of ``n`` device flag slots until it is waited or cancelled
(the flag protocol: ``csrc/cp_fast.cu``); slots go round-robin, the same sequence on every rank. A slot used inside a
CUDA graph capture is *pinned* (the graph raises its generation at every replay) while the graph lives. Each rank learns
of a destroyed graph at its own time (``freed()``: a CUDA user object the graph owns), so freed slots are unpinned only
by an agreed reclaim (the intersection of every rank's freed slots) at points that are the same on every rank: a capture
past ``reclaim_at`` pinned slots, or no unpinned slot left.
"""

from __future__ import annotations

_EAGER_MIN = 8  # slots a capture leaves unpinned (for eager calls), whatever the graphs still alive hold


class CallSlots:
    """Device flag slots for calls in flight: round-robin, never reused before their call was waited/cancelled.

    Args:
        n: slots (the most un-waited calls at once).
        agree: ``obj -> [obj of each group rank]``, a bounded exchange needing no CUDA; None: this rank alone (tests).
        freed: ``() -> [slot, ...]``: pinned slots whose CUDA graph was destroyed since the last call; None: never.
    """

    def __init__(self, n: int, agree=None, freed=None):
        self.n = n
        self.owner: list = [None] * n  # call index holding the slot (launched, not waited), or None
        self.pinned: set = set()  # slots captured into a CUDA graph still alive (the same set on every rank)
        self.freed_here: set = set()  # pinned slots whose graph this rank saw destroyed, not reclaimed yet
        self.agree, self.freed = agree, freed
        self.reclaim_at = n // 2  # pinned slots at which a capturing acquire reclaims first
        self.eager_min = max(1, min(_EAGER_MIN, n // 4))  # slots captures never pin
        self.reclaims = 0
        self.reclaim = None  # () -> None: give back what abandoned launches hold (set by the lane)
        self.next = 0

    def acquire(self, call: int, capturing: bool = False) -> int:
        """The next slot for ``call`` (``capturing``: pin it to the graph being captured). Raises RuntimeError when
        the next slot still holds an un-waited call (more than ``n`` in flight), or when captured graphs still alive
        hold every slot but ``eager_min`` (8 of 256)."""
        if capturing and len(self.pinned) >= min(self.reclaim_at, self.n - self.eager_min):
            self._reclaim()
        if capturing and len(self.pinned) >= self.n - self.eager_min:
            raise RuntimeError(
                f"cp_ops fast transport: call {call} is being captured into a CUDA graph, but captured graphs still "
                f"alive hold {len(self.pinned)} of the {self.n} flag slots (each captured fast call keeps one until its "
                f"graph is destroyed; {self.eager_min} stay for eager calls): destroy graphs you no longer replay (on every "
                "rank), or release the lane (FastTransport.shutdown())")
        s = self.next
        for _ in range(self.n):
            if s in self.pinned:
                s = (s + 1) % self.n
                continue
            if self.owner[s] is not None and self.reclaim is not None:
                self.reclaim()  # works dropped un-waited give their slots back (Lane.reclaim_dropped)
            if self.owner[s] is not None:
                inflight = sorted(c for c in self.owner if c is not None)
                raise RuntimeError(
                    f"cp_ops fast transport: call {call} needs a flag slot but slot {s} still holds call {self.owner[s]}, "
                    f"launched and not waited; {len(inflight)} fast calls are in flight (calls {inflight[:8]}"
                    f"{'...' if len(inflight) > 8 else ''}), the most the lane allows is {self.n - len(self.pinned)}. "
                    "Wait each launch (torch.ops._c10d_functional.wait_tensor / work.wait()) before launching more, "
                    "or cancel a launch that will not be waited (work.cancel(), e.g. after an exception)")
            self.owner[s] = call
            self.next = (s + 1) % self.n
            if capturing:
                self.pinned.add(s)
            return s
        raise RuntimeError(
            f"cp_ops fast transport: every one of the {self.n} flag slots is held by a captured CUDA graph still "
            "alive; destroy graphs you no longer replay (on every rank), or release the lane (FastTransport.shutdown())"
        )

    def _reclaim(self) -> None:
        """Unpin the slots every rank saw freed with their graph (the same on every rank: agreed)."""
        if self.freed is not None:
            self.freed_here.update(s for s in self.freed() if s in self.pinned)
        mine = sorted(self.freed_here)
        views = self.agree(mine) if self.agree is not None else [mine]
        common = set(views[0]).intersection(*map(set, views[1:]))
        self.pinned -= common
        self.freed_here -= common
        self.reclaims += 1
        # the next reclaim after a few more captured calls: not at every captured launch while graphs stay alive
        self.reclaim_at = max(self.n // 2, len(self.pinned) + self.n // 16)

    def release(self, slot: int, call: int) -> None:
        if self.owner[slot] == call:
            self.owner[slot] = None

    def in_flight(self) -> list:
        return sorted(c for c in self.owner if c is not None)
