"""Faults of the fast transport on CPU (issue 20 items 2, 6, 9, 10, 11): the host side of each fix, driven through the
real FastTransport / Lane / CallSlots / Pool code with a stand-in for the CUDA extension (no GPU). The device side
(poisoned outputs, launch ordering after an abandoned call, graph-freed slots) is in the gpu-marked tests of tests/test_fast.py."""

from __future__ import annotations

import types

import pytest
import torch

from cp_ops import config
from cp_ops.transport import fast
from cp_ops.transport.fast import collective, lane as flane, pool as fpool, slots as fslots


class _Ext:
    """The extension's Lane as the host uses it: records launches and waits, raises nothing."""

    def __init__(self):
        self.launches, self.waits, self.err = [], [], []

    def error(self):
        return self.err

    def launch(self, cur, call, slot, descs, path, inflight, split, sm_blocks, outputs):
        self.launches.append((call, slot, outputs))

    def wait(self, stream, slot, record_done):
        self.waits.append((stream, slot))

    def wait_source(self, stream, slot, src):
        self.waits.append((stream, slot, src))


def _cpu_lane(monkeypatch, world=2, n_slots=flane.N_SLOTS):
    """A real Lane whose extension is :class:`_Ext` and whose pool is CPU memory (rank 0 of ``world``)."""
    mem = []

    def alloc(n):
        t = torch.zeros(n, dtype=torch.uint8)
        mem.append(t)
        return flane.Segment(t.data_ptr(), [t.data_ptr()] * world, n, t)

    def make(ptr, n):
        for t in mem:
            if t.data_ptr() <= ptr < t.data_ptr() + t.numel():
                return t[ptr - t.data_ptr():ptr - t.data_ptr() + n]
        raise AssertionError("pointer outside every allocation")

    pool = fpool.Pool(alloc, lambda seg: None, make, lambda obj: [obj] * world, lambda: None, 1 << 24, 1 / 64)
    group = types.SimpleNamespace(rank=lambda: 0, size=lambda: world)
    lane = flane.Lane(group, list(range(world)), torch.device("cpu"), None, _Ext(), None, None, pool, "nvlink", [],
                      fslots.CallSlots(n_slots))
    monkeypatch.setattr(flane, "_current_stream", lambda device: _stream[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(config.settings, "fast_tune", False)
    monkeypatch.setattr(fast.transport, "_lane_for", lambda group: lane)
    monkeypatch.setattr(fast.transport, "_works", type(fast.transport._works)())
    _stream[0] = 7
    return lane


_stream = [7]  # the "current stream" the stand-in _current_stream returns


def _kv(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 8, 4, 16, generator=g).to(torch.bfloat16) for _ in range(2))


# ---- item 9: an exception between launch and wait ------------------------------------------------------
def test_launches_abandoned_by_an_exception_do_not_break_the_transport(monkeypatch):
    """A launch whose caller fails before the wait (an OOM in the attention issued between them) and drops the work:
    before, the same shape failed from the 3rd such call on ("would overwrite pool slot") and every launch from the
    257th on ("in flight"), until a collective shutdown. Now a dropped, never-waited work gives its flag slot and
    pool slots back; 600 abandoned launches later a normal call works."""
    lane = _cpu_lane(monkeypatch)
    T = fast.transport
    k, v = _kv(1)

    def layer_that_runs_out_of_memory():
        kf, vf, work = T.agkv_start(k, v, None)
        raise MemoryError("CUDA out of memory (injected, in the attention between launch and wait)")

    for _ in range(600):
        with pytest.raises(MemoryError):
            layer_that_runs_out_of_memory()
    kf, vf, work = T.agkv_start(k, v, None)
    work.wait()
    assert lane.calls == 601 and lane.slots.in_flight() == []
    assert all(p is None for e in lane.pool.entries.values() for p in e.pending)


def test_cancel_gives_the_call_up_and_a_later_wait_says_so(monkeypatch):
    lane = _cpu_lane(monkeypatch)
    T = fast.transport
    k, v = _kv(2)
    works = []
    for _ in range(3 * flane.N_SLOTS):  # works kept by the caller (not dropped): cancel is what frees them
        kf, vf, work = T.agkv_start(k, v, None)
        work.cancel()
        works.append(work)
    assert lane.slots.in_flight() == [] and lane.ext_lane.waits == []  # no device work: host state only
    work = works[-1]
    assert work.is_completed()
    work.cancel()  # idempotent
    with pytest.raises(RuntimeError, match=r"call \d+ was cancelled \(work.cancel\(\)\): its outputs were never "
                                           r"completed"):
        work.wait()
    kf, vf, w2 = T.agkv_start(k, v, None)
    w2.wait()
    w2.cancel()  # after a wait: nothing to give up
    assert w2.settled and lane.slots.in_flight() == []
    lane.ext_lane.err = [2, 5, 5, 1, 0, 1, 10**9]  # a device timeout recorded: cancel still never raises
    flane.FastWork(lane, 99, 3, [("no such key", 0, 99)]).cancel()


def test_in_flight_message_names_cancel(monkeypatch):
    slots = fslots.CallSlots(2)
    slots.acquire(0)
    slots.acquire(1)
    with pytest.raises(RuntimeError, match=r"slot 0 still holds call 0.*work.cancel\(\)"):
        slots.acquire(2)


# ---- item 10: waiting one launch on a second stream ------------------------------------------------------
class _Event:
    log: list = []

    def record(self, stream):
        _Event.log.append(("record", stream.ptr))

    def synchronize(self):
        pass


class _ExternalStream:
    def __init__(self, ptr, device=None):
        self.ptr = ptr

    def wait_event(self, ev):
        _Event.log.append(("wait", self.ptr))


def test_second_stream_wait_joins_the_first_stream(monkeypatch):
    """Before: the second stream's wait raised at once ('... before 256 more launches'). Now it waits for the first
    stream (an event recorded there); once the outputs' pool buffer went to a later call, it raises naming that."""
    lane = _cpu_lane(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "ExternalStream", _ExternalStream)
    _Event.log = []
    T = fast.transport
    k, v = _kv(3)
    kf, vf, work = T.agkv_start(k, v, None)
    _stream[0] = 11
    work.wait()  # first wait: the device wait, on stream 11
    assert lane.ext_lane.waits == [(11, work.slot)]
    _stream[0] = 12
    work.wait()  # a second stream: joined to the first
    T.wait_source(kf, 1)  # per-source on the second stream: already joined, nothing more
    assert _Event.log == [("record", 11), ("wait", 12)] and lane.ext_lane.waits == [(11, work.slot)]
    _stream[0] = 11
    work.wait()  # the first stream again: nothing
    assert len(_Event.log) == 2
    a = T.agkv_start(k, v, None)  # the next two calls of the shape: the second takes work's pool buffer again
    b = T.agkv_start(k, v, None)
    _stream[0] = 13
    with pytest.raises(RuntimeError, match=r"output of call 0 \(agkv.k .*\) is waited on a second stream after its "
                                           r"pool buffer went to call 2: a fast output is valid until the second-next "
                                           r"call of the same shape"):
        work.wait()
    a[2].wait()
    b[2].wait()


# ---- item 11: flag slots of destroyed CUDA graphs ---------------------------------------------------------
def _graph_slots_body(rank, world):
    """Two ranks capture 10 graphs of 40 fast calls each, destroying each graph after use; rank 1 learns of each
    destruction one graph later than rank 0 (the user-object destructors run on CUDA's own thread, at their own
    time). The slot sequences must stay equal on every rank, and no capture may run out of slots."""
    import torch.distributed as dist

    g = dist.group.WORLD
    freed_queue: list = []

    def freed():  # what the extension's freed_slots() hands over: the queue so far, emptied
        out = list(freed_queue)
        freed_queue.clear()
        return out

    ex = collective.Exchange(g, "test-slots")
    slots = fslots.CallSlots(flane.N_SLOTS, lambda obj: ex("flag-slot reclaim", obj), freed)
    seq, call, late = [], 0, []
    for graph in range(10):
        captured = []
        for _ in range(40):  # the capture: launch + wait per call (pinned to the graph)
            s = slots.acquire(call, capturing=True)
            slots.release(s, call)
            captured.append(s)
            seq.append(s)
            call += 1
        for _ in range(5):  # eager calls between captures
            s = slots.acquire(call)
            slots.release(s, call)
            seq.append(s)
            call += 1
        # the graph is destroyed: its slots reach the queue now (rank 0) or one graph later (rank 1)
        if rank == 0:
            freed_queue.extend(captured)
        else:
            freed_queue.extend(late)
            late = captured
    everyone = [None] * world
    dist.all_gather_object(everyone, seq)
    assert everyone[0] == everyone[1], "the ranks' slot sequences differ"
    assert slots.reclaims > 0 and len(slots.pinned) <= flane.N_SLOTS // 2 + 40


def test_flag_slots_of_destroyed_graphs_come_back_alike_on_every_rank():
    """Capture -> destroy -> capture 10 graphs of 40 fast calls (400 captured calls > 256 slots). Before: the 7th
    capture raised 'every one of the 256 flag slots is held by a captured CUDA graph' (slots stayed pinned until
    shutdown). Now the slots of destroyed graphs come back through an agreed reclaim, identically on every rank."""
    from dist_util import run_ranks

    run_ranks(_graph_slots_body, 2, timeout=120)


def test_graph_slots_still_alive_raise_naming_the_fix():
    slots = fslots.CallSlots(16)  # keeps max(1, min(8, 16 // 4)) = 4 slots for eager calls
    for c in range(12):
        slots.release(slots.acquire(c, capturing=True), c)
    with pytest.raises(RuntimeError, match=r"captured graphs still alive hold 12 of the 16 flag slots.*destroy graphs "
                                           r"you no longer replay"):
        slots.acquire(12, capturing=True)
    assert slots.acquire(13) not in slots.pinned  # eager calls still run


# ---- item 2 (host side): every output buffer goes to the device for poisoning --------------------------------
def test_every_output_buffer_is_handed_to_the_launch_for_poisoning(monkeypatch):
    """The device poisons (NaN) the buffers it is given when a wait of the call times out; before, a launch named
    none, so a timed-out call's outputs looked normal."""
    lane = _cpu_lane(monkeypatch, world=4)
    T = fast.transport
    k, v = _kv(4)
    kf, vf, w = T.agkv_start(k, v, None)
    assert lane.ext_lane.launches[-1][2] == [(kf.data_ptr(), kf.numel() * 2), (vf.data_ptr(), vf.numel() * 2)]
    x = torch.randn(1, 8, 4, 16)
    buf, w2 = T.ulysses_start([x, x], None)
    assert lane.ext_lane.launches[-1][2] == [(buf.data_ptr(), buf.numel() * 4)]
    inv, w3 = T.ulysses_inverse_start(x, None)
    assert lane.ext_lane.launches[-1][2] == [(inv.data_ptr(), inv.numel() * 4)]
    for w_ in (w, w2, w3):
        w_.wait()
    lane.ext_lane.err = [2, 1, 1, 3, 0, 1, 2 * 10**9]  # what the device recorded: the next host touch raises
    with pytest.raises(RuntimeError, match=r"device wait timed out after 2.0 s"):
        T.agkv_start(k, v, None)


# ---- item 6 (pool growth): a failure on one rank is every rank's error ------------------------------------
def _pool(views, alloc=None, room=None):
    mem = []

    def default_alloc(n):
        t = torch.zeros(n, dtype=torch.uint8)
        mem.append(t)
        return flane.Segment(t.data_ptr(), [t.data_ptr(), t.data_ptr()], n, t)

    def make(ptr, n):
        for t in mem:
            if t.data_ptr() <= ptr < t.data_ptr() + t.numel():
                return t[ptr - t.data_ptr():ptr - t.data_ptr() + n]
        raise AssertionError("outside")

    return fpool.Pool(alloc or default_alloc, lambda s: None, make, views, lambda: None, 1 << 20, 1 / 1024, room=room)


def test_pool_growth_short_of_memory_on_a_peer_raises_alike():
    """Group rank 1 has no room: every rank raises naming it, before any rank enters the collective allocation."""
    allocs = []
    pool = _pool(lambda obj: [obj, obj[:4] + ("12 MiB free on GPU 1, 64 MiB needed",)] if len(obj) == 5 else [obj, obj],
                 alloc=lambda n: allocs.append(n), room=lambda n: None)
    with pytest.raises(RuntimeError, match=r"pool cannot grow by a \(256,\) float32 .* on every rank: group rank 1: "
                                           r"12 MiB free on GPU 1, 64 MiB needed"):
        pool.get("a", (256,), torch.float32, call=0)
    assert allocs == []


def test_pool_growth_failing_on_a_peer_raises_alike_and_stops_growth():
    pool = _pool(lambda obj: [obj, (obj[0], "RuntimeError: nvshmem_malloc failed")] if len(obj) == 2 else [obj, obj])
    with pytest.raises(RuntimeError, match=r"symmetric allocation of 0.0 MiB for a \(256,\) float32 failed on group "
                                           r"rank 1: RuntimeError: nvshmem_malloc failed.*shutdown"):
        pool.get("a", (256,), torch.float32, call=0)
    with pytest.raises(RuntimeError, match="failed on group rank 1"):
        pool.get("b", (256,), torch.float32, call=1)


# ---- the bounded exchange: a rank that never comes costs the bound, and everyone gets the same answer ----------
def _exchange_body(rank, world):
    import time

    import torch.distributed as dist

    ex = collective.Exchange(dist.group.WORLD, "test-exchange", timeout_s=2)
    assert ex("first", rank * 10) == [0, 10]
    if rank == 1:
        time.sleep(4)  # misses the second exchange's bound
    t0 = time.time()
    try:
        ex("the second exchange", rank)
        raise AssertionError("must raise")
    except collective.PeerTimeout as e:
        msg = str(e)
    assert "the second exchange: group ranks [1]" in msg and "within 2 s (CP_OPS_TIMEOUT_S)" in msg, msg
    if rank == 0:
        assert time.time() - t0 < 6
    seen = [None] * world
    dist.all_gather_object(seen, msg)
    assert seen[0] == seen[1]  # the late rank too: the first outcome decided


def test_exchange_is_bounded_and_agreed():
    from dist_util import run_ranks

    run_ranks(_exchange_body, 2, timeout=60)
