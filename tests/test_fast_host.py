"""The fast transport's per-launch host state on CPU: works reused only when nobody can reach them."""

from __future__ import annotations

import pytest
import torch
from torch._C._distributed_c10d import _register_work

from cp_ops.transport import fast
from cp_ops.transport.fast import heap as fheap, lane as flane, pool as fpool


def _lane():
    lane = flane.Lane.__new__(flane.Lane)  # no device: only the work bookkeeping is used
    lane.spare = [object()]
    return lane


def test_a_work_is_reused_only_once_waited_and_unreferenced(monkeypatch):
    lane = _lane()
    w0 = lane._work(0, 0, ["t0"])
    assert isinstance(w0, flane.FastWork) and (w0.call, w0.slot, w0.tickets) == (0, 0, ["t0"])
    first = id(w0)
    assert lane._work(1, 1, []) is not w0  # not waited yet (and still named here)
    w0._first = 7  # what FastWork.wait records (the stream it waited on)
    w2 = lane._work(2, 2, [])
    assert w2 is not w0  # waited, but this test still holds it
    t = torch.zeros(3)
    _register_work(t, w0)  # c10d's registry (compiled code's wait_tensor) holds it now
    del w0
    w3 = lane._work(3, 3, [])
    assert id(w3) != first  # registered, not waited through the registry: still reachable
    monkeypatch.setattr(flane.FastWork, "wait", lambda self, timeout=None: True)
    torch.ops._c10d_functional.wait_tensor(t)  # the registry lets it go
    w4 = lane._work(4, 4, ["t4"])
    assert id(w4) == first and (w4.call, w4.slot, w4.tickets) == (4, 4, ["t4"]) and w4._first is None and not w4.settled


def test_the_lane_keeps_a_bounded_number_of_works():
    lane = _lane()
    held = [lane._work(c, c, []) for c in range(3 * flane._SPARE_WORKS)]  # all in flight
    assert len({id(w) for w in held}) == len(held)
    assert len(lane.spare) == 1 + flane._SPARE_WORKS


def test_a_reused_work_no_longer_answers_for_its_old_outputs(monkeypatch):
    """FastTransport.wait_source(t) finds a pending output's work by address; once a work is reused for another
    launch, the outputs of its previous launch map to nothing (KeyError), as when the work was a new object."""
    lane = _lane()
    pool = fpool.Pool(lambda n: _seg(n), lambda seg: None, _make, lambda obj: [obj, obj], lambda: None,
                              1 << 20, 1 / 1024, slots=2)

    class Stub:
        rank, world, calls = 0, 2, 0

        def __init__(self):
            self.pool = pool

        def next_call(self):
            return self.calls

        def capturing(self):
            return False

        def launch(self, key, descs, inputs, tickets, outputs=()):
            self.calls += 1
            return lane._work(self.calls, self.calls, tickets)

    stub = Stub()
    monkeypatch.setattr(fast.transport, "_lane_for", lambda g: stub)
    monkeypatch.setattr(fast.transport, "_works", type(fast.transport._works)())
    x = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    buf, work = fast.transport.ulysses_inverse_start(x, None)
    assert fast.transport._works[buf.data_ptr()] is work
    old_ptr, old_id = buf.data_ptr(), id(work)
    for t in work.tickets:
        pool.consumed(t)
    work._first = 1
    del work
    k = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    kf, vf, work = fast.transport.agkv_start(k, k, None)  # another key: other buffers, the same work object
    assert id(work) == old_id and fast.transport._works[kf.data_ptr()] is work
    assert old_ptr not in fast.transport._works
    with pytest.raises(KeyError):
        fast.transport.wait_source(buf, 1)


_mem: list = []


def _seg(n):
    t = torch.zeros(n, dtype=torch.uint8)
    _mem.append(t)
    return fheap.Segment(t.data_ptr(), [t.data_ptr(), t.data_ptr() + (1 << 40)], n, t)


def _make(ptr, n):
    for t in _mem:
        if t.data_ptr() <= ptr < t.data_ptr() + t.numel():
            return t[ptr - t.data_ptr():ptr - t.data_ptr() + n]
    raise AssertionError("pointer outside every allocation")


@pytest.mark.parametrize("world,b,s,hl,d,lo,hi", [(2, 1, 6, 4, 8, 0, 2), (2, 2, 5, 4, 8, 1, 4), (4, 2, 3, 3, 4, 1, 2),
                                                  (3, 1, 4, 2, 8, 0, 2)])
def test_descriptors_ulysses_head_range(world, b, s, hl, d, lo, hi, monkeypatch):
    """fast ulysses_start_heads (pipelined Ulysses' sub-group) delivers, byte for byte, what the torch transport's
    all-to-all of layout.ulysses_pack(xs, W, lo, hi) delivers (emulated ranks, copies applied row by row)."""
    from test_fast import _data, _emulate

    from cp_ops import layout

    xs = [[_data((b, s, world * hl, d), r, 30 + i) for i in range(3)] for r in range(world)]
    outs = _emulate(world, monkeypatch, lambda r: fast.transport.ulysses_start_heads(xs[r], None, lo, hi))
    packs = [layout.ulysses_pack(xs[r], world, lo, hi) for r in range(world)]
    for me, (buf, _work) in enumerate(outs):
        want = torch.stack([packs[src][me] for src in range(world)])
        assert buf.shape == want.shape == (world, b, s, 3, hi - lo, d) and torch.equal(buf, want)
