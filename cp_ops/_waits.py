"""How a rank waits for its peers: one spin-then-poll loop (:func:`poll`), one warning schedule and one timeout message
for every wait cp_ops makes on other ranks (:mod:`cp_ops.contract`, :mod:`cp_ops._peers`). A wait is a
:class:`PeerWait`: :meth:`PeerWait.tick` warns past ``settings.wait_warn_s`` and again at 3x, 6x, 12x, ... that delay;
:meth:`PeerWait.error` is the error at ``settings.timeout_s``, in the same words everywhere (``docs/faults.md``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from . import config

log = logging.getLogger("cp_ops")

#: Seconds between a wait's checks of its peers (liveness, published failures, the warning and the bound).
CHECK_EVERY_S = 0.25
#: the warning times, in multiples of ``settings.wait_warn_s``: 1, 3, 6, then doubling
_FIRST = (1, 3, 6)
CAUSES = ("a rank skipped this call (e.g. an `if rank == 0:` around a model or layer call), is still loading or "
          "compiling, or crashed on another host")


class PeersTimeout(RuntimeError):
    """Some peers did not arrive within ``CP_OPS_TIMEOUT_S`` (the message names them and the call)."""


def _factor(k: int) -> float:
    return _FIRST[k] if k < len(_FIRST) else _FIRST[-1] * 2 ** (k - len(_FIRST) + 1)


class PeerWait:
    """One wait of this rank on some of its peers. ``call``: the call in the user's words, with its group (e.g.
    ``"cp_ops.attention call #3 on CP group '0'"``); ``stage``: where in that call it waits, and ``after``: what
    happens next (e.g. that a retry works), both for the error's details line."""

    __slots__ = ("call", "stage", "after", "t0", "timeout_s", "warn_s", "warned", "next_warn")

    def __init__(self, call: str, stage: str, after: str = "", timeout_s: float | None = None):
        self.call, self.stage, self.after = call, stage, after
        self.t0 = time.monotonic()
        self.timeout_s = config.settings.timeout_s if timeout_s is None else timeout_s
        self.warn_s = config.settings.wait_warn_s
        self.warned, self.next_warn = 0, self.t0 + self.warn_s

    def waited(self) -> float:
        return time.monotonic() - self.t0

    def expired(self) -> bool:
        return time.monotonic() - self.t0 >= self.timeout_s

    def tick(self, missing) -> None:
        """Log the warning when it is due; ``missing``: the ranks not yet there, in words (a str, or a callable
        returning one, called only when a warning is due)."""
        now = time.monotonic()
        if now < self.next_warn:
            return
        who = missing() if callable(missing) else missing
        log.warning("cp_ops: %s: %s not there after %.0f s; this rank waits until CP_OPS_TIMEOUT_S=%g s, then "
                    "raises. Likely: %s", self.call, who, now - self.t0, self.timeout_s, CAUSES)
        self.warned += 1
        self.next_warn = self.t0 + self.warn_s * _factor(self.warned)

    def error(self, missing: str) -> PeersTimeout:
        """The error of a wait that reached ``CP_OPS_TIMEOUT_S``: one line in the user's terms, details after."""
        more = f"; {self.after}" if self.after else ""
        return PeersTimeout(
            f"{self.call}: {missing} did not arrive within CP_OPS_TIMEOUT_S={self.timeout_s:g} s. Check that every "
            f"rank makes this call: {CAUSES}; raise CP_OPS_TIMEOUT_S if a rank is only slow to start.\n"
            f"  (this rank waited in {self.stage}{more})")


def poll(done: Callable[[], bool], check: Callable[[], bool]) -> bool:
    """Call ``done()`` until it returns True (then return True): 200 ``sched_yield`` spins first (peers in step answer
    within µs), then sleeps of 50 µs (1 ms after 2,000 polls). ``check()`` runs at the first poll past the spins and
    every :data:`CHECK_EVERY_S` s after it; it may warn or raise, or return True to give up (then return False)."""
    spins, next_check = 0, 0.0
    while not done():
        spins += 1
        if spins < 200:
            os.sched_yield()
            continue
        now = time.monotonic()
        if now >= next_check:
            if check():
                return False
            next_check = now + CHECK_EVERY_S
        time.sleep(0.00005 if spins < 2000 else 0.001)
    return True
