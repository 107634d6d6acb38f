"""The fast lane: one CP group on one node, its launches (:meth:`Lane.launch`), their works (:class:`FastWork`), the
per-shape fan-out decisions (measured once, max over ranks) and the bounded device waits. CUDA graphs: a replay needs
nothing from the host (the begin kernel raises the slot's generation on the device, timeouts use ``%globaltimer``,
events exist from the lane's start, decisions fall back to the deterministic default while capturing); the lane's start
and a pool key's first allocation raise a named error inside a capture, and pool keys used in one are kept until
:meth:`Lane.close`. Bounded waits: every device spin gives up after ``settings.timeout_s`` and records what it waited
for in mapped host memory, which :meth:`Lane.check` (at every launch and wait) raises as a RuntimeError naming the call,
the peer, the flag and the values.
"""

from __future__ import annotations

import gc
import logging
import statistics
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ... import config
from ..._ext import current_stream as _current_stream
from .collective import group_barrier
from .heap import Segment
from .pool import Pool
from .slots import CallSlots

log = logging.getLogger("cp_ops")

N_SLOTS = 256  # device flag slots: the most un-waited fast calls in flight at once
_SPARE_WORKS = 8  # finished works a lane keeps for reuse (Lane._work)
_FLAGS = {1: "ready", 2: "arrived", 3: "arrived (wait_source)"}


class FastWork(dist.Work):
    """Completion of one fast call.

    ``wait()``: the first makes the current CUDA stream wait for every chunk (a bounded spin kernel on the peers'
    arrival flags; a timeout poisons the outputs with NaN) and gives back the flag slot and pool slots; again on
    that stream: a no-op; on another stream: it waits for the first (an event), until the outputs' pool buffers go
    to a later call (RuntimeError). ``wait_source(src)``: group rank ``src``'s chunk only. ``cancel()``: see there.
    ``is_completed()``: this rank's own copies only (True once waited or cancelled). ``wait`` raises RuntimeError
    after a device timeout (:meth:`Lane.check`), a cancel, the lane's shutdown, or the outputs' recycling."""

    def __init__(self, lane: "Lane", call: int, slot: int, tickets: list):
        super().__init__()
        self.lane, self.call, self.slot, self.tickets = lane, call, slot, tickets
        self.ptrs: tuple = ()  # addresses of its outputs (FastTransport's wait_source map)
        self._reset(call, slot, tickets)

    def _reset(self, call: int, slot: int, tickets: list) -> None:
        """Reuse for a new launch (see :meth:`Lane._work`): only when settled and referenced by nobody."""
        self.call, self.slot, self.tickets = call, slot, tickets
        self._first = None  # the stream (cudaStream_t) the call was first waited on; None before
        self._joined: tuple = ()  # other streams made to wait for the first one
        self._cancelled = False

    @property
    def settled(self) -> bool:
        """Waited (on some stream) or cancelled: the flag slot and pool slots are given back."""
        return self._first is not None or self._cancelled

    def _give_back(self) -> None:
        lane = self.lane
        lane.slots.release(self.slot, self.call)
        for t in self.tickets:
            lane.pool.consumed(t)

    def _held(self) -> None:
        if self._cancelled:
            raise RuntimeError(f"cp_ops fast transport: call {self.call} was cancelled (work.cancel()): its outputs "
                               "were never completed; launch it again")
        if self.lane.slots.owner[self.slot] != self.call:
            raise RuntimeError(f"cp_ops fast transport: call {self.call} was already released (its lane was shut down)")

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - c10d signature
        lane = self.lane
        lane.check()
        s = _current_stream(lane.device)
        if s == self._first or s in self._joined:
            return True
        if self._first is None:
            self._held()
            lane.ext_lane.wait(s, self.slot, True)
            self._first = s
            self._give_back()
        else:
            self._join(s)
        return True

    def _join(self, s: int) -> None:
        """Make stream ``s`` wait for the stream the call was first waited on (a second-stream wait)."""
        lane = self.lane
        gone = [(t, lane.pool.writer(t)) for t in self.tickets if lane.pool.writer(t) != t[2]]
        if gone:
            (key, _i, _c), now = gone[0]
            raise RuntimeError(
                f"cp_ops fast transport: an output of call {self.call} ({key[0]} {key[1]}) is waited on a second stream "
                f"after its pool buffer went to {'call ' + str(now) if now is not None else 'eviction'}: a fast output "
                f"is valid until the second-next call of the same shape; wait it on every stream before that")
        dev = lane.device
        ev = torch.cuda.Event()
        ev.record(torch.cuda.ExternalStream(self._first, device=dev))
        torch.cuda.ExternalStream(s, device=dev).wait_event(ev)
        self._joined += (s,)

    def wait_source(self, src: int) -> None:
        lane = self.lane
        lane.check()
        s = _current_stream(lane.device)
        if self._first is not None:  # the whole call was waited: this stream needs that wait, nothing more
            if s != self._first and s not in self._joined:
                self._join(s)
            return
        self._held()
        lane.ext_lane.wait_source(s, self.slot, src)

    def cancel(self) -> None:
        """Give up a launched call that will not be waited (unwinding after an exception between launch and wait):
        its flag slot and pool slots come back at once, its outputs are invalid. Never raises and touches no CUDA
        state (safe in ``except``/``finally``, after a device fault too); a no-op once waited or cancelled. The
        device stays ordered: the next launch in that flag slot waits for this call's own copies and signals
        (``csrc/cp_fast.cu``). A later :meth:`wait` raises RuntimeError naming the cancel."""
        if self.settled:
            return
        self._cancelled = True
        try:
            self._give_back()
        except Exception:  # noqa: BLE001 - never mask the exception being unwound
            pass

    def is_completed(self) -> bool:
        if self.settled:
            return True
        self.lane.check()
        return self.lane.ext_lane.query(self.slot)

    def __del__(self):  # dropped un-waited (a launch abandoned by an exception): give its slots back
        try:
            if not self._cancelled and self._first is None:
                self.cancel()
        except Exception:  # noqa: BLE001 - interpreter shutdown, half-built object
            pass


# ---- lane ---------------------------------------------------------------------------------------
@dataclass
class Decision:
    path: int  # 0 = copy engine, 1 = SM kernel
    inflight: int
    split: int
    sm_blocks: int
    ms: float | None = None

    def label(self) -> str:
        if self.path == 0:
            return f"ce(inflight={self.inflight},split={self.split})"
        return f"sm(inflight={self.inflight},blocks={self.sm_blocks})"


def format_error(err: list, ranks: list) -> str:
    flag, call, slot, peer, seen, want, ns = err
    what = _FLAGS.get(flag, f"flag {flag}")
    peer_txt = f"group rank {peer} (global rank {ranks[peer]})" if 0 <= peer < len(ranks) else f"rank {peer}"
    side = ("its begin (ready to receive)" if flag == 1 else "its data for this call")
    return (f"cp_ops fast transport: a device wait timed out after {ns / 1e9:.1f} s (CP_OPS_TIMEOUT_S): call {call} "
            f"(slot {slot}) waited for {peer_txt}'s {what} flag = {want}, saw {seen}; that peer never sent {side} "
            "(did it stop, crash, or skip this call?). The lane is unusable: call FastTransport.shutdown()")


@dataclass
class Lane:
    group: dist.ProcessGroup
    ranks: list
    device: torch.device
    ext: object
    ext_lane: object
    heap: object
    ctrl: Segment
    pool: Pool
    fabric: str
    streams: list
    slots: CallSlots
    calls: int = 0
    decisions: dict = field(default_factory=dict)
    # works kept for reuse (see _work); entry 0 is a sentinel only this list references
    spare: list = field(default_factory=lambda: [object()])

    def __post_init__(self):
        self.pool.reclaim = self.slots.reclaim = self.reclaim_dropped

    @property
    def world(self) -> int:
        return len(self.ranks)

    def reclaim_dropped(self) -> None:
        """Cancel every never-waited launch whose work nobody can reach (run when a launch finds its flag slot or
        pool slot still held, before raising); collects reference cycles first (a traceback can hold the work)."""
        gc.collect()
        base = -1
        for w in self.spare:  # as in _work: the sentinel's count is that of an object only this list holds
            n = sys.getrefcount(w)
            if base < 0:
                base = n
            elif n == base and not w.settled:
                w.cancel()

    @property
    def rank(self) -> int:
        return self.group.rank()

    def check(self) -> None:
        """Raise the first device-wait timeout recorded on this lane (RuntimeError naming call, peer, flag)."""
        err = self.ext_lane.error()
        if err:
            raise RuntimeError(format_error(list(err), self.ranks))

    # -- one call -----------------------------------------------------------------------------
    def next_call(self) -> int:
        return self.calls

    def capturing(self) -> bool:
        """True while the current stream is capturing a CUDA graph (a launch then stays with the graph)."""
        return torch.cuda.is_current_stream_capturing()

    def launch(self, key: tuple, descs: list, inputs: list, tickets: list, force: Decision | None = None,
               outputs: list = ()) -> FastWork:
        """Launch one call (``descs[t]``: the copies into rank t's buffers); ``outputs``: ``[(address, bytes)]`` of
        this rank's output buffers, poisoned (NaN) by the device when a wait of this call times out."""
        self.check()
        d = force or self.decide(key, descs, inputs)
        cur = _current_stream(self.device)
        # the caching allocator must not hand the inputs out while the side streams (local + send) read them
        readers = self.streams[: 1 + min(d.inflight, max(1, self.world - 1)) * max(1, d.split)]
        for t in inputs:
            for s in readers:
                t.record_stream(s)
        call = self.calls
        slot = self.slots.acquire(call, torch.cuda.is_current_stream_capturing())
        self.calls += 1
        try:
            self.ext_lane.launch(cur, call, slot, descs, d.path, d.inflight, d.split, d.sm_blocks, list(outputs))
        except Exception:
            self.slots.release(slot, call)
            raise
        return self._work(call, slot, tickets)

    def _work(self, call: int, slot: int, tickets: list) -> FastWork:
        """The work of a launch: a kept one nobody references any more, reset (cancelled first if never waited), else
        a new one, kept when there is room (building a ``dist.Work`` was a fast launch's largest host cost)."""
        spare = self.spare
        base = -1
        for w in spare:  # the sentinel first: its count is the count of an object only this list holds
            n = sys.getrefcount(w)
            if base < 0:
                base = n
            elif n == base:
                if not w.settled:
                    w.cancel()
                w._reset(call, slot, tickets)
                return w
        w = FastWork(self, call, slot, tickets)
        if len(spare) <= _SPARE_WORKS:
            spare.append(w)
        return w

    def candidates(self, aligned: bool, ce_only: bool = False) -> list[Decision]:
        """The fan-outs measured for one shape; ``ce_only``: copy-engine ones only (a transfer under compute),
        unless ``CP_OPS_FAST_PATH=sm``."""
        remote = max(1, self.world - 1)
        infl = [1] if self.fabric == "shared-egress" else sorted({1, remote})
        out = []
        sm_ok = aligned and (config.settings.fast_path == "sm" or (config.settings.fast_path == "auto" and not ce_only))
        if config.settings.fast_path in ("auto", "ce") or not aligned:
            out += [Decision(0, i, s, 0) for i in infl for s in (1, 2)]
        if sm_ok:
            out += [Decision(1, infl[-1], 1, b) for b in (32, 64, 128)]
        return out

    def default(self, aligned: bool) -> Decision:
        remote = max(1, self.world - 1)
        if config.settings.fast_path == "sm" and aligned:
            return Decision(1, remote if self.fabric != "shared-egress" else 1, 1, 64)
        return Decision(0, remote if self.fabric != "shared-egress" else 1, 1, 0)

    def decide(self, key: tuple, descs: list, inputs: list) -> Decision:
        """Fan-out for this shape: measured once (max over ranks, so every rank picks the same), cached."""
        full_key = (config.settings.fast_path,) + key
        if full_key in self.decisions:
            return self.decisions[full_key]
        aligned = _aligned(descs)
        ce_only = key[-1] == "under_compute"
        if not config.settings.fast_tune or torch.cuda.is_current_stream_capturing():
            return self.default(aligned)  # deterministic on every rank; not cached, so eager calls still tune
        cands = self.candidates(aligned, ce_only)
        times = [self._time(descs, inputs, c) for c in cands]
        t = torch.tensor(times, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        times = t.tolist()
        best = min(range(len(cands)), key=lambda i: times[i])
        d = cands[best]
        d.ms = times[best]
        self.decisions[full_key] = d
        log.info("cp_ops fast: %s -> %s (%.3f ms; tried %s)", key, d.label(), d.ms,
                 ", ".join(f"{c.label()}={x:.3f}" for c, x in zip(cands, times)))
        return d

    def _time(self, descs, inputs, c: Decision, warmup: int = 2, reps: int = 5) -> float:
        ms = []
        for i in range(warmup + reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.launch(None, descs, inputs, [], force=c).wait()
            b.record()
            b.synchronize()
            if i >= warmup:
                ms.append(a.elapsed_time(b))
        self.check()
        return statistics.median(ms)

    def describe(self) -> dict:
        return {"group_ranks": list(self.ranks), "width": self.world, "device": str(self.device),
                "fabric": self.fabric, "heap": self.heap.name, "calls": self.calls, "call_slots": self.slots.n,
                "in_flight": len(self.slots.in_flight()), "pool": self.pool.describe(),
                "decisions": {"/".join(map(str, k)): d.label() for k, d in self.decisions.items()}}

    def close(self):
        del self.spare[1:]
        group_barrier(self.group, self.device)
        self.ext_lane.release()
        self.pool.release_all()
        self.heap.free(self.ctrl)
        group_barrier(self.group, self.device)
        self.heap.close()


def _aligned(descs: list) -> bool:
    return not any((dst | src | width | dpitch | spitch) & 15
                   for ds in descs for dst, src, width, _height, dpitch, spitch in ds)
