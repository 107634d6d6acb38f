"""Fast transport on CPU: selection, fallback, error messages, the pool, and the copy descriptors.

The descriptor test runs the real ``fast.agkv_start`` / ``ulysses_start`` / ``ulysses_inverse_start`` code
for W simulated ranks with a fake lane whose heaps are CPU tensors, applies every copy the way the copy
engine would (row by row, byte-exact) and checks the results against the torch transport's layouts.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys

import pytest
import torch

from cp_ops import layout
from cp_ops import config
from cp_ops.transport import _fast_build, _fast_runtime, base, fast


def test_reason_cpu_tensors_names_torch():
    r = fast.unavailable_reason("cpu")
    assert "'cpu'" in r and "transport='torch'" in r


def test_explicit_fast_raises_with_reason_and_auto_falls_back_once(caplog):
    with pytest.raises(RuntimeError, match=r"transport='fast' cannot run: the tensors are on 'cpu'"):
        base.select_transport("fast", "cpu")
    base._logged.discard(("fast", "cpu"))
    with caplog.at_level(logging.INFO, logger="cp_ops"):
        assert base.select_transport("auto", "cpu") == "torch"
        assert base.select_transport("auto", "cpu") == "torch"
    msgs = [r.getMessage() for r in caplog.records if "uses 'torch'" in r.getMessage()]
    assert len(msgs) == 1 and "fast unavailable" in msgs[0]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend torch sees a GPU whose properties the test sets; clears the per-device reason cache."""
    state = {"cap": (9, 0), "spec": object()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: state["cap"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    import importlib.util as iu

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: state["spec"] if name == "nvshmem" else real(name, *a))
    fast._reason_cache.clear()
    yield state
    fast._reason_cache.clear()


def test_reason_not_hopper(fake_cuda):
    fake_cuda["cap"] = (8, 0)
    r = fast.unavailable_reason("cuda", 0)
    assert "compute capability 8.0" in r and "needs 9.0" in r and "Fake GPU" in r


def test_reason_nvshmem_missing(fake_cuda, monkeypatch):
    fake_cuda["spec"] = None
    monkeypatch.delenv("CP_OPS_FAST_HEAP", raising=False)
    r = fast.unavailable_reason("cuda", 0)
    assert "nvshmem4py is not installed" in r and "CP_OPS_FAST_HEAP=ipc" in r


def test_reason_build_failure_names_log(fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setattr(config.settings, "ext_dir", str(tmp_path))
    monkeypatch.setattr(_fast_build, "_state", {})
    from torch.utils import cpp_extension

    def boom(**kw):
        raise RuntimeError("Error building extension 'cp_ops_fast_ext': nvcc fatal: planted failure")

    monkeypatch.setattr(cpp_extension, "load", boom)
    r = fast.unavailable_reason("cuda", 0)
    log = tmp_path / "build.log"
    assert "failed to build" in r and str(log) in r
    assert "planted failure" in log.read_text()
    with pytest.raises(RuntimeError, match="build log"):
        base.select_transport("fast", "cuda")
    monkeypatch.setattr(_fast_build, "_state", {})


def test_reason_missing_source(monkeypatch, tmp_path):
    monkeypatch.setattr(_fast_build, "_SOURCE", tmp_path / "nope.cu")
    monkeypatch.setattr(_fast_build, "_state", {})
    mod, why = _fast_build.load()
    assert mod is None and "nope.cu" in why and "missing" in why
    monkeypatch.setattr(_fast_build, "_state", {})


def test_import_stays_light():
    code = (
        "import sys, cp_ops; import cp_ops.transport.fast as f; f.describe(); "
        "bad=[m for m in ('nvshmem','cp_ops.transport._fast_build','cp_ops_fast_ext') if m in sys.modules]; "
        "assert not bad, bad; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_configure_validation(monkeypatch):
    s = config.settings
    saved = config.snapshot()
    with pytest.raises(ValueError, match="CP_OPS_FAST_HEAP='mpi' is not allowed: use one of nvshmem/ipc"):
        fast.configure(heap="mpi")
    with pytest.raises(ValueError, match="CP_OPS_FAST_PATH='tma' is not allowed"):
        fast.configure(path="tma")
    fast.configure(path="sm", pool_gb=2)
    assert (s.fast_path, s.fast_pool_gb) == ("sm", 2.0)
    d = fast.describe()
    assert d["settings"]["path"] == "sm" and d["settings"]["pool_gb"] == 2.0 and d["lane"] is None
    monkeypatch.setattr(fast, "_lane", object())
    with pytest.raises(RuntimeError, match="shutdown"):
        fast.configure(pool_gb=4)
    monkeypatch.setattr(fast, "_lane", None)
    config.restore(saved)


def test_pool_slots_reuse_and_overflow():
    heap = torch.zeros(4096 + 1024, dtype=torch.uint8)
    pool = _fast_runtime.Pool(heap, start=1024, capacity=4096, cap_gb=4096 / 2**30)
    a0, o0 = pool.get("agkv.k", (1, 8, 4, 8), torch.bfloat16)  # 512 bytes
    a1, o1 = pool.get("agkv.k", (1, 8, 4, 8), torch.bfloat16)
    a2, o2 = pool.get("agkv.k", (1, 8, 4, 8), torch.bfloat16)
    assert (o0, o1, o2) == (1024, 1024 + 512, 1024) and a2.data_ptr() == a0.data_ptr()
    assert a0.shape == (1, 8, 4, 8) and a0.dtype == torch.bfloat16
    a0.fill_(3.0)
    assert heap[1024:1536].view(torch.bfloat16).eq(3.0).all() and heap[1536:2048].eq(0).all()
    with pytest.raises(RuntimeError, match=r"pool is full: ulysses \(2, 64, 8, 8\).*CP_OPS_FAST_POOL_GB"):
        pool.get("ulysses", (2, 64, 8, 8), torch.float32)
    assert pool.describe()["used_bytes"] == 1024


# ---- descriptor emulation -----------------------------------------------------------------------
class _EmuLane:
    """A lane whose heap is a CPU tensor; launches are recorded and applied later by :func:`_apply`."""

    def __init__(self, rank, world, heaps):
        self.rank, self.world, self.heaps = rank, world, heaps
        self.pool = _fast_runtime.Pool(heaps[rank], start=64, capacity=heaps[rank].numel() - 64, cap_gb=1)
        self.launched = []

    def launch(self, key, descs, inputs):
        assert len(descs) == self.world
        self.launched.append((descs, inputs))
        return "work"


def _apply(lanes):
    for lane in lanes:
        for descs, _inputs in lane.launched:
            for t, ds in enumerate(descs):
                base = lanes[t].heaps[t].data_ptr()
                for dst_off, src, width, height, dpitch, spitch in ds:
                    assert dst_off + (height - 1) * dpitch + width <= lanes[t].heaps[t].numel()
                    for row in range(height):
                        ctypes.memmove(base + dst_off + row * dpitch, src + row * spitch, width)
        lane.launched.clear()


def _emulate(world, monkeypatch, fn):
    heaps = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(world)]
    lanes = [_EmuLane(r, world, heaps) for r in range(world)]
    outs = []
    monkeypatch.setattr(fast, "_register", lambda *a: None)
    for r in range(world):
        monkeypatch.setattr(fast, "_lane_for", lambda g, _l=lanes[r]: _l)
        outs.append(fn(r))
    _apply(lanes)
    return outs


def _data(shape, r, i, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(1000 * i + r)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("world,b,s,h,d", [(2, 1, 6, 4, 8), (2, 2, 5, 6, 8), (4, 2, 3, 8, 4), (3, 2, 4, 6, 8)])
def test_descriptors_agkv(world, b, s, h, d, monkeypatch):
    ks = [_data((b, s, h, d), r, 1) for r in range(world)]
    vs = [_data((b, s, h, d), r, 2) for r in range(world)]
    outs = _emulate(world, monkeypatch, lambda r: fast.agkv_start(ks[r], vs[r], None))
    want_k, want_v = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
    for kf, vf, work in outs:
        assert work == "work" and kf.shape == (b, world * s, h, d)
        assert torch.equal(kf, want_k) and torch.equal(vf, want_v)


@pytest.mark.parametrize("world,b,s,h,d,n", [(2, 1, 6, 4, 8, 3), (2, 2, 5, 6, 8, 2), (4, 2, 3, 8, 4, 3), (3, 1, 4, 6, 8, 1)])
def test_descriptors_ulysses(world, b, s, h, d, n, monkeypatch):
    xs = [[_data((b, s, h, d), r, 10 + i) for i in range(n)] for r in range(world)]
    outs = _emulate(world, monkeypatch, lambda r: fast.ulysses_start(xs[r], None))
    packs = [layout.ulysses_pack(xs[r], world) for r in range(world)]
    for me, (buf, work) in enumerate(outs):
        want = torch.stack([packs[src][me] for src in range(world)])  # what all_to_all_single delivers
        assert buf.shape == want.shape and torch.equal(buf, want)


@pytest.mark.parametrize("world,b,s,hl,d", [(2, 1, 8, 2, 8), (2, 2, 6, 3, 8), (4, 2, 8, 2, 4), (3, 2, 6, 2, 8)])
def test_descriptors_ulysses_inverse(world, b, s, hl, d, monkeypatch):
    xs = [_data((b, s, hl, d), r, 20) for r in range(world)]
    outs = _emulate(world, monkeypatch, lambda r: fast.ulysses_inverse_start(xs[r], None))
    packs = [layout.ulysses_inverse_pack(xs[r], world) for r in range(world)]
    for me, (buf, work) in enumerate(outs):
        want = torch.stack([packs[src][me] for src in range(world)])
        assert buf.shape == want.shape and torch.equal(buf, want)


def test_descriptors_double_buffer(monkeypatch):
    """Two back-to-back calls of one shape land in different slots; the third reuses the first."""
    world = 2
    heaps = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(world)]
    lane = _EmuLane(0, world, heaps)
    monkeypatch.setattr(fast, "_lane_for", lambda g: lane)
    monkeypatch.setattr(fast, "_register", lambda *a: None)
    k = _data((1, 4, 2, 8), 0, 1)
    p = [fast.agkv_start(k, k, None)[0].data_ptr() for _ in range(3)]
    assert p[0] != p[1] and p[2] == p[0]


def test_candidates_shared_egress_single_stream():
    lane = _fast_runtime.Lane.__new__(_fast_runtime.Lane)
    lane.ranks, lane.fabric = [0, 1, 2, 3], "shared-egress"
    s = config.settings
    old = s.fast_path
    s.fast_path = "auto"
    try:
        cands = lane.candidates(aligned=True)
        assert {c.inflight for c in cands} == {1}
        lane.fabric = "nvlink"
        cands = lane.candidates(aligned=True)
        assert {c.inflight for c in cands} == {1, 3} and any(c.path == 1 for c in cands)
        assert all(c.path == 0 for c in lane.candidates(aligned=False))
    finally:
        s.fast_path = old


# ---- group probe (one node, P2P reachability, fabric) on 2 gloo ranks -----------------------------
_SCENARIOS = {
    "ok": (None, "nvlink"),
    "pcie": (None, "shared-egress"),
    "two_nodes": "spans more than one node",
    "no_p2p": "cannot access peer GPU",
    "hidden": "not visible to this process",
}


def _probe_body(rank, world):
    import socket
    import types

    import torch.distributed as dist

    for scenario, want in _SCENARIOS.items():
        visible = 1 if scenario == "hidden" else world
        # uuids: every rank sees GPU-0..GPU-{visible-1}; in 'hidden' each rank's own GPU has a private uuid
        own = f"GPU-private-{rank}" if scenario == "hidden" else f"GPU-{rank}"
        torch.cuda.get_device_properties = lambda d, own=own: types.SimpleNamespace(
            uuid=own if not isinstance(d, int) else f"GPU-{d}")
        torch.cuda.device_count = lambda visible=visible: visible
        socket.gethostname = lambda host=(f"node{rank}" if scenario == "two_nodes" else "node0"): host

        class Ext:
            @staticmethod
            def p2p_attributes(dev, peer, scenario=scenario):
                return [0 if scenario == "no_p2p" else 1, 0 if scenario == "pcie" else 1, 0]

        dev = types.SimpleNamespace(index=rank, type="cuda")
        got = _fast_runtime.probe_group(dist.group.WORLD, dev, Ext)
        if isinstance(want, tuple):
            assert got == want, (scenario, got)
        else:
            assert got[0] is not None and want in got[0], (scenario, got)


def test_probe_group_reasons_agreed_by_all_ranks():
    """Multi-node, unreachable and hidden peers give a reason on every rank; PCIe-like links collapse the
    fabric to 'shared-egress' (one remote stream)."""
    from dist_util import run_ranks

    run_ranks(_probe_body, 2, timeout=60)


def test_auto_falls_back_to_torch_for_a_group_that_cannot_host_the_lane(monkeypatch, caplog):
    """A group-level refusal (node span, P2P reach, build) raises under 'fast' and uses torch under 'auto'."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import cp_ops._library as lib

    assert base.resolve("auto", "cpu") == "torch" and base.resolve("torch", "cpu") == "torch"
    calls = []

    def unfit(group, device):
        calls.append(group.size())
        raise _fast_runtime.GroupUnfit("transport='fast' cannot run: the CP group spans more than one node")

    monkeypatch.setattr(fast, "unavailable_reason", lambda *a, **k: None)
    monkeypatch.setattr(_fast_runtime, "create_lane", unfit)
    monkeypatch.setattr(fast, "_lane", None)
    monkeypatch.setattr(fast, "_unfit", {})
    monkeypatch.setattr(base, "_logged", set())
    monkeypatch.setattr(base, "_group_choice", {})
    monkeypatch.setattr(config.settings, "fast_lane_width", None)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        g = dist.group.WORLD
        dev = torch.device("cpu")
        with pytest.raises(RuntimeError, match="spans more than one node"):
            base.for_group("fast", g, dev)
        with caplog.at_level(logging.INFO, logger="cp_ops"):
            assert base.for_group("auto", g, dev).name == "torch"
            assert base.for_group("auto", g, dev).name == "torch"
        assert calls == [2]  # probed once, the verdict cached for the group
        assert sum("transport='auto'" in r.getMessage() for r in caplog.records) == 1
    finally:
        dist.destroy_process_group()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert base.resolve("auto", "cuda") == "auto"  # the device could run fast: the group decides
