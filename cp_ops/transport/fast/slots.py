"""The fast lane's call slots: each launched call owns one of ``n`` device flag slots until it is waited
(``csrc/cp_fast.cu`` has the flag protocol); slots are given round-robin, the same sequence on every rank."""

from __future__ import annotations


class CallSlots:
    """Device flag slots for calls in flight: round-robin, never reused before their call was waited."""

    def __init__(self, n: int):
        self.n = n
        self.owner: list = [None] * n  # call index holding the slot (launched, not waited), or None
        self.pinned: set = set()  # slots captured into a CUDA graph
        self.next = 0

    def acquire(self, call: int, capturing: bool = False) -> int:
        s = self.next
        for _ in range(self.n):
            if s in self.pinned:
                s = (s + 1) % self.n
                continue
            if self.owner[s] is not None:
                inflight = sorted(c for c in self.owner if c is not None)
                raise RuntimeError(
                    f"cp_ops fast transport: call {call} needs a flag slot but slot {s} still holds call {self.owner[s]}, "
                    f"launched and not waited; {len(inflight)} fast calls are in flight (calls {inflight[:8]}"
                    f"{'...' if len(inflight) > 8 else ''}), the most the lane allows is {self.n - len(self.pinned)}. "
                    "Wait each launch (torch.ops._c10d_functional.wait_tensor / work.wait()) before launching more"
                )
            self.owner[s] = call
            self.next = (s + 1) % self.n
            if capturing:
                self.pinned.add(s)
            return s
        raise RuntimeError(
            f"cp_ops fast transport: every one of the {self.n} flag slots is held by a captured CUDA graph; "
            "release the lane (FastTransport.shutdown()) to free them"
        )

    def release(self, slot: int, call: int) -> None:
        if self.owner[slot] == call:
            self.owner[slot] = None

    def in_flight(self) -> list:
        return sorted(c for c in self.owner if c is not None)
