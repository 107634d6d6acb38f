"""Faults and ordering of the fast transport with real peers, W ranks sharing ONE GPU (marked gpu; skipped without
CUDA): each rank a process on cuda:0 in a ``cpu:gloo,cuda:gloo`` group, the fast lane over CUDA IPC.

* an exception between launch and wait (every rank raises inside pipelined AGKV): the launches are cancelled, the
  next calls work and equal one device; the raw lane too, with only one rank failing (tests/test_fast.py's body);
* the go-ahead gate: a peer's copy into this rank's buffer starts only once this rank's stream reached the call
  (its begin kernel), for the copy engine and the SM copy path; a write without the gate, made first, proves the
  window is seen;
* capture -> free -> capture of 10 whole-forward CUDA graphs (``cp_ops.captured.capture_forward``) of a 40-layer model,
  40 fast calls each: the freed graphs' flag slots come back (10 x 40 > the lane's 256);
* one launch waited on two streams (tests/test_fast.py's body).

A peer that never arrives and a rank killed mid-call are in tests/test_one_gpu.py. Each test writes its record to
``$TEST_SHARED_DEVICE_OUT`` (``benchmarks/gpu_one.sh OUT faults``) when that is set.
"""

import json
import os

import pytest
import torch
from dist_util import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _record(name, w, what, **extra):
    out = os.environ.get("TEST_SHARED_DEVICE_OUT")
    if out:
        with open(os.path.join(out, f"fault_{name}_{w}.json"), "w") as f:
            json.dump(dict(world_size=w, transport="fast", heap=os.environ.get("CP_OPS_FAST_HEAP"), what=what,
                           passed=True, max_err=extra.pop("max_err", None), **extra), f)


def _rand(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


@pytest.fixture
def ipc(monkeypatch):
    monkeypatch.setenv("CP_OPS_FAST_HEAP", "ipc")
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "60")


# ---- an exception between launch and wait ------------------------------------------------------------------------
def _raise_between_launch_and_wait(rank, w):
    import cp_ops
    from cp_ops.modes import agkv_pipelined
    from cp_ops.transport import fast

    s, h, d = 512 * w, 4 * w, 128
    sl = slice(rank * s // w, (rank + 1) * s // w)

    def call(seed, chunks):
        q, k, v = (_rand((1, s, h, d), seed + i) for i in range(3))
        out = cp_ops.attention(q[:, sl], k[:, sl], v[:, sl], mode="agkv", chunks=chunks, transport="fast")
        return out, cp_ops.local_attention(q, k, v)[:, sl]

    call(1, 2)  # the lane, the pool buffers, the shape's decision
    real = agkv_pipelined.attention_with_lse
    n = [0]

    def boom(*a, **kw):  # the first stage's attention, issued after the launch and before its wait
        n[0] += 1
        if n[0] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected between launch and wait)")
        return real(*a, **kw)

    agkv_pipelined.attention_with_lse = boom
    try:
        for i in range(fast.transport.slots_per_key + 3):  # more than the shape's pool slots: each was given back
            n[0] = 0
            with pytest.raises(torch.OutOfMemoryError, match="injected"):
                call(10 + i, 2)
            assert n[0] == 1
    finally:
        agkv_pipelined.attention_with_lse = real
    torch.cuda.synchronize()
    fast.check()
    assert fast.transport.lane.slots.in_flight() == [], fast.transport.lane.slots.in_flight()
    worst = 0.0
    for i in range(4):  # the next calls work: pipelined within the LSE merge's rounding, chunks=1 bitwise
        out, ref = call(100 + 3 * i, 2)
        e = (out.float() - ref.float()).abs().max().item()
        assert e / ref.float().abs().max().item() < 2e-2, (i, e)
        worst = max(worst, e)
        out, ref = call(200 + 3 * i, 1)
        assert torch.equal(out, ref), i
    torch.cuda.synchronize()
    fast.check()
    if rank == 0:
        _record("raise_between", w, "exception between launch and wait (every rank, pipelined agkv): next calls work",
                max_err=worst)


def test_exception_between_launch_and_wait_next_calls_work(ipc):
    run_ranks(_raise_between_launch_and_wait, 2, timeout=180, device="one_gpu")


def _abandoned_raw(rank, w):
    from test_fast import _abandoned

    _abandoned(rank, w)  # only rank 0 fails, 300 launches, cancelled or dropped; then bitwise equal, none in flight
    if rank == 0:
        _record("abandoned", w, "launches abandoned by an exception on one rank (300, cancelled or dropped): "
                "the lane stays usable")


def test_launches_abandoned_on_one_rank_leave_the_lane_usable(ipc):
    run_ranks(_abandoned_raw, 2, timeout=240, device="one_gpu")


# ---- the go-ahead gate -------------------------------------------------------------------------------------------
def _go_ahead_gate(rank, w):
    """Rank 1 keeps its stream busy (a ~0.5 s sleep kernel), then reads the pool slot call C will fill, then launches
    C; rank 0 launches C at once. Its copy into rank 1's slot must wait for rank 1's begin (after the read): the read
    sees what the slot held before C. First, without the gate: rank 0 writes a marker straight into rank 1's slot
    (its IPC mapping) while rank 1 sleeps, and rank 1's read must see it (so the window is real)."""
    import torch.distributed as dist

    from cp_ops.transport import fast

    pg = dist.group.WORLD
    T = fast.transport
    b, s, h, d = 1, 1024, 8, 128
    sleep = 1_000_000_000  # GPU cycles (~0.5 s)
    for p_i, path in enumerate(("ce", "sm")):
        fast.configure(path=path)
        shape = (b, s + 64 * p_i, h, d)  # a pool key of its own per path
        for j in range(2):  # calls A, B: both pool slots written, the decision made
            k = _rand(shape, 10 * j + rank)
            kf, vf, wk = T.agkv_start(k, k, pg)
            wk.wait()
        del kf, vf
        lane = T.lane
        e = lane.pool.entries[("agkv.k", (b, w * shape[1], h, d), torch.bfloat16)]
        i = e.turn  # the slot call C will use
        block = shape[1] * h * d  # rank 0's rows of the gathered K (B = 1): the first block
        marker = torch.full((block,), 3.0, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        # 1. without the gate: rank 0 writes into rank 1's slot while rank 1 sleeps; rank 1 reads it after the sleep
        dist.barrier()
        if rank == 0:
            peer = lane.pool.make(e.addrs[i][1], block * 2).view(torch.bfloat16)
            peer.copy_(marker)
        else:
            torch.cuda._sleep(sleep)
            snap = e.slots[i].reshape(-1)[:block].clone()
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            assert torch.equal(snap, marker), (path, "the ungated write was not seen: the window is not tested")
        # 2. with the gate (call C): the same window; rank 1's read must still see the marker, not rank 0's C data
        k = _rand(shape, 100 + rank)
        dist.barrier()
        if rank == 1:
            torch.cuda._sleep(sleep)
            snap = e.slots[i].reshape(-1)[:block].clone()
        kf, vf, wk = T.agkv_start(k, k, pg)
        assert kf.data_ptr() == e.slots[i].data_ptr(), "call C did not get the slot the test reads"
        wk.wait()
        got = kf.clone()
        torch.cuda.synchronize()
        want = torch.cat([_rand(shape, 100 + r) for r in range(w)], 1)
        assert torch.equal(got, want), path
        if rank == 1:
            assert torch.equal(snap, marker), (path, "rank 0's copy landed before rank 1's stream reached the call")
        dist.barrier()
    fast.check()
    if rank == 0:
        _record("go_ahead", w, "go-ahead gate: a peer's copy (copy engine, SM) waits for this rank's stream")


def test_copy_engine_go_ahead_gate(ipc):
    run_ranks(_go_ahead_gate, 2, timeout=180, device="one_gpu")


# ---- capture -> free -> capture: 10 whole-forward graphs of a 40-layer model -------------------------------------
class _Layers(torch.nn.Module):
    """40 layers, each one fast AGKV attention over its input and a residual: 40 fast calls a forward."""

    def __init__(self, n=40):
        super().__init__()
        self.scales = [0.5 + 0.01 * i for i in range(n)]
        self.register_buffer("one", torch.ones((), device="cuda", dtype=torch.bfloat16))  # on CUDA: capturable

    def forward(self, x):
        import cp_ops

        x = x * self.one
        for a in self.scales:
            x = x + cp_ops.attention(x * a, x, x, mode="agkv", chunks=1, transport="fast")
        return x


def _ten_whole_forward_graphs(rank, w):
    import gc

    import torch.distributed as dist

    from cp_ops.captured import capture_forward
    from cp_ops.transport import fast

    pg = dist.group.WORLD
    shape = (1, 128, 4, 64)
    eager = _Layers()
    with torch.no_grad():
        eager(_rand(shape, 1 + rank))  # the lane, pool buffers, decisions
    lane = fast.transport.lane
    slots = lane.slots
    for g_i in range(10):
        net = capture_forward(_Layers(), group=pg, warmup=1)
        with torch.no_grad():
            net(_rand(shape, 1000 * g_i + rank))  # warm-up and capture
            for it in range(2):
                x = _rand(shape, 1000 * g_i + 10 * (it + 1) + rank)
                got = net(x)
                want = eager(x)
                assert torch.equal(got, want), (g_i, it, (got.float() - want.float()).abs().max().item())
        assert len(slots.pinned) >= 40, (g_i, len(slots.pinned))  # the live graph holds its 40 calls' slots
        del net, got
        gc.collect()
        torch.cuda.synchronize()
        dist.barrier()
    assert slots.reclaims > 0 and len(slots.pinned) < slots.n - slots.eager_min, (slots.reclaims, len(slots.pinned))
    with torch.no_grad():  # eager afterwards
        x = _rand(shape, 77 + rank)
        a, b_ = eager(x), eager(x)
    assert torch.equal(a, b_)
    fast.check()
    if rank == 0:
        _record("ten_graphs", w, "capture -> free -> capture 10 whole-forward graphs of a 40-layer model "
                "(400 captured fast calls, 256 slots): slots returned", reclaims=slots.reclaims)


def test_capture_free_capture_ten_whole_forward_graphs(ipc):
    run_ranks(_ten_whole_forward_graphs, 2, timeout=300, device="one_gpu")


# ---- one launch waited on two streams ----------------------------------------------------------------------------
def _two_streams_shared(rank, w):
    from test_fast import _two_streams

    _two_streams(rank, w)
    if rank == 0:
        _record("two_streams", w, "one launch waited on two streams (the late one first)")


def test_one_launch_waited_on_two_streams(ipc):
    run_ranks(_two_streams_shared, 2, timeout=180, device="one_gpu")
