"""cp_ops.transport.fake_fill: a fake group's collectives hold real data for the zero-communication bound.

torch 2.11's fake backend (the GPU machine's) leaves the all-to-all's output unwritten; newer torch (CI's) copies the
input. Here a fixture makes this torch's fake group write nothing at all (its collectives return a real fake work),
so the tests that use it fail if cp_ops' fill does not write: the outputs start as NaN and must end
equal to this rank's own data in every slot (fresh random inputs, never zeros)."""

import pytest
import torch
import torch.distributed as dist

from cp_ops.transport import fake_fill
from cp_ops.transport.torch import TorchTransport

PATCHED = ("alltoall_base", "_allgather_base", "allgather_into_tensor_coalesced")


@pytest.fixture
def fake4():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield dist.group.WORLD
    fake_fill.disable()
    dist.destroy_process_group()


@pytest.fixture
def unwritten(fake4):
    """This torch's fake group as torch 2.11's: each collective returns a fake work and leaves its output alone."""
    cls = dist.ProcessGroup
    raw = {n: vars(cls)[n] for n in PATCHED}
    scratch = torch.zeros(4)

    def a2a(self, out, inp, *a, **k):
        return raw["alltoall_base"].__get__(self)(scratch.clone(), scratch, [], [])

    def ag(self, out, inp, *a, **k):
        return raw["_allgather_base"].__get__(self)(torch.zeros(16), scratch)

    def agc(self, outs, ins, *a, **k):
        return raw["allgather_into_tensor_coalesced"].__get__(self)([torch.zeros(16)], [scratch])

    for n, f in zip(PATCHED, (a2a, ag, agc)):
        setattr(cls, n, f)
    try:
        yield fake4
    finally:
        for n, f in raw.items():
            setattr(cls, n, f)


def _nan_probe(pg, kind):
    """Does ``pg`` leave a ``kind`` output unwritten? (NaN-filled output, random input.)"""
    inp = torch.randn(8)
    if kind == "alltoall_base":
        out = torch.full((8,), float("nan"))
        pg.alltoall_base(out, inp, [], []).wait()
    elif kind == "_allgather_base":
        out = torch.full((32,), float("nan"))
        pg._allgather_base(out, inp).wait()
    else:
        out = torch.full((32,), float("nan"))
        pg.allgather_into_tensor_coalesced([out], [inp]).wait()
    return bool(torch.isnan(out).any())


def test_enable_probes_what_the_backend_writes(fake4):
    got = fake_fill.enable(fake4, torch.device("cpu"))
    assert fake_fill.ACTIVE and got["recv"] is True
    for kind in PATCHED:
        assert got[kind] == _nan_probe(fake4, kind), kind
    fake_fill.disable()
    assert not fake_fill.ACTIVE


def test_enable_sees_an_unwritten_backend(unwritten):
    got = fake_fill.enable(unwritten, torch.device("cpu"))
    assert all(got[k] for k in PATCHED), got


def test_enable_refuses_a_real_group(fake4, monkeypatch):
    monkeypatch.setattr(fake_fill.dist, "get_backend", lambda g: "gloo")
    with pytest.raises(ValueError, match="'fake' backend.*'gloo' with 4 ranks"):
        fake_fill.enable(fake4, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["alltoall_base", "_allgather_base", "allgather_into_tensor_coalesced", "recv"])
def test_fill_writes_own_data_in_every_slot(unwritten, kind):
    fake_fill.enable(unwritten, torch.device("cpu"))
    inp = torch.randn(3, 5, 2)
    out = torch.full((3, 5, 2) if kind == "alltoall_base" else (12, 5, 2), float("nan"))
    fake_fill.fill(kind, unwritten, out, inp)
    want = inp if kind == "alltoall_base" else inp.repeat(4, 1, 1)
    assert torch.equal(out, want) and (out != 0).all()


def test_transport_sites_write_real_data(unwritten):
    """The torch transport's AGKV all-gather, its point-to-point gather, Ulysses' two all-to-alls and the comm's
    mask gather, on a fake group that writes nothing: every output is this rank's data, none NaN or stale."""
    from cp_ops import layout
    from cp_ops.comm import DirectComm

    fake_fill.enable(unwritten, torch.device("cpu"))
    t = TorchTransport()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 4, 4, 8, generator=g), torch.randn(2, 4, 4, 8, generator=g)
    with fake_fill.recording() as rec:
        kf, vf, _ = t.agkv_start(k, v, unwritten)
        kp, vp, _, _ = t.agkv_start_sources(k, v, unwritten, pieces=2)
        buf, _ = t.ulysses_start([k, v], unwritten)
        inv, _ = t.ulysses_inverse_start(k, unwritten)
        comm = DirectComm(unwritten, t)
        mask = (torch.rand(2, 4, generator=g) > 0.3).to(torch.uint8)
        mf = comm.mask(mask).wait()
    for full, x in ((kf, k), (vf, v), (kp, k), (vp, v)):
        assert torch.equal(full, x.repeat(1, 4, 1, 1))
    assert torch.equal(buf, layout.ulysses_pack([k, v], 4))
    assert torch.equal(inv, layout.ulysses_inverse_pack(k, 4))
    assert torch.equal(mf, mask.repeat(4, 1))
    kinds = [r[0] for r in rec]
    assert kinds.count("allgather_into_tensor_coalesced") == 4 and kinds.count("recv") == 4
    assert kinds.count("alltoall_base") == 2 and kinds.count("_allgather_base") == 1


def test_parallelized_model_outputs_real_data(unwritten):
    """A tiny Wan parallelized over the fake group (Ulysses at W = 4): with the fill, rank 0's forward output is
    finite and every fake write recorded (the attention's all-to-alls and the output gather)."""
    from cp_ops.cli.bound import shared_copy
    from cp_ops.cli.models import MODELS, build
    from cp_ops.integrations.diffusers import parallelize

    spec = MODELS["wan"]
    model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    g = torch.Generator().manual_seed(1)
    kw = spec.make_inputs(cfg, 16, 1, 2, 16, 16, torch.device("cpu"), torch.float32, g)
    m = shared_copy(model)
    parallelize(m, unwritten, mode="ulysses", transport="torch")
    fake_fill.enable(unwritten, torch.device("cpu"))
    with fake_fill.recording() as rec, torch.no_grad():
        out = spec.predict(m, kw)
    assert out.shape == spec.predict(model, kw).shape and torch.isfinite(out).all()
    kinds = {r[0] for r in rec}
    assert "alltoall_base" in kinds and "_allgather_base" in kinds
    assert fake_fill.replay_ms(rec, torch.device("cpu")) > 0


def test_nothing_on_a_group_that_is_not_fake(fake4, monkeypatch):
    fake_fill.enable(fake4, torch.device("cpu"))
    monkeypatch.setattr(fake_fill.dist, "get_backend", lambda g: "gloo")  # as a real group
    out, inp = torch.full((4,), float("nan")), torch.randn(4)
    with fake_fill.recording() as rec:
        fake_fill.fill("alltoall_base", fake4, out, inp)
    assert rec == [] and torch.isnan(out).all()


def test_records_say_who_wrote(fake4, monkeypatch):
    """Each record names its writer — cp_ops' fill (a kind the backend leaves unwritten) or torch's fake backend —
    so the replay copies as that writer did; on CPU the replay is timed launched (no CUDA graph), and asking for a
    graph off CUDA is refused with the rule."""
    fake_fill.enable(fake4, torch.device("cpu"))
    monkeypatch.setitem(fake_fill._unwritten, "alltoall_base", True)
    monkeypatch.setitem(fake_fill._unwritten, "_allgather_base", False)
    inp = torch.randn(3, 5)
    with fake_fill.recording() as rec:
        fake_fill.fill("alltoall_base", fake4, torch.empty(3, 5), inp)
        fake_fill.fill("_allgather_base", fake4, torch.empty(12, 5), inp)
    assert [(r[0], r[-1]) for r in rec] == [("alltoall_base", "cp_ops"), ("_allgather_base", "torch")]
    assert fake_fill.replay_ms(rec, torch.device("cpu")) > 0
    with pytest.raises(RuntimeError, match="graphed=True needs a CUDA device; got cpu"):
        fake_fill.replay_ms(rec, torch.device("cpu"), graphed=True)


def test_torch_writes_replayed_per_chunk():
    """torch's own writes are replayed as its fake backend makes them: every chunk of the output = the input."""
    inp = torch.randn(2, 3)
    out = torch.full((8, 3), float("nan"))
    fake_fill._write_as_torch(out, inp)
    assert torch.equal(out, inp.repeat(4, 1))


def test_gathers_written_by_cp_ops_not_run_on_a_fake_group(fake4, monkeypatch):
    """With filling on, the all-gathers cp_ops issues on a fake group (the AGKV gather, the key-mask gathers of the
    comm and of the op) are written by cp_ops, one copy per tensor, and the fake backend's collective (one copy per
    chunk: a host loop over W) is not called; outputs = this rank's data in every chunk, recorded as cp_ops'."""
    from cp_ops.comm import DirectComm

    fake_fill.enable(fake4, torch.device("cpu"))

    def refuse(self, *a, **k):
        raise AssertionError("the fake backend's all-gather ran")

    for n in ("_allgather_base", "allgather_into_tensor_coalesced"):
        monkeypatch.setattr(dist.ProcessGroup, n, refuse)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 4, 4, 8, generator=g), torch.randn(2, 4, 4, 8, generator=g)
    mask = (torch.rand(2, 4, generator=g) > 0.3).to(torch.uint8)
    with fake_fill.recording() as rec:
        kf, vf, work = TorchTransport().agkv_start(k, v, fake4)
        work.wait()
        mf = DirectComm(fake4, TorchTransport()).mask(mask).wait()
        mo = torch.ops.cp_ops.mask_gather_start(mask, 4, fake4.group_name)
        torch.ops._c10d_functional.wait_tensor(mo)
    assert torch.equal(kf, k.repeat(1, 4, 1, 1)) and torch.equal(vf, v.repeat(1, 4, 1, 1))
    assert torch.equal(mf, mask.repeat(4, 1)) and torch.equal(mo, mask.repeat(4, 1))
    assert [(r[0], r[-1]) for r in rec] == [("allgather_into_tensor_coalesced", "cp_ops")] * 4 \
        + [("_allgather_base", "cp_ops")] * 2


def test_gather_leaves_a_group_that_is_not_fake_alone(fake4, monkeypatch):
    """fake_fill.gather on a group whose backend is not 'fake': None (the caller runs its collective), nothing written
    or recorded; a group's verdict is asked once per group object and forgotten by disable()."""
    fake_fill.enable(fake4, torch.device("cpu"))
    asked = []

    def backend(g):
        asked.append(g)
        return "gloo"

    monkeypatch.setattr(fake_fill.dist, "get_backend", backend)
    out, inp = torch.full((16,), float("nan")), torch.randn(4)
    with fake_fill.recording() as rec:
        assert fake_fill.gather("_allgather_base", fake4, [out], [inp]) is None
        assert fake_fill.gather("_allgather_base", fake4, [out], [inp]) is None
    assert rec == [] and torch.isnan(out).all() and asked == [fake4]
    fake_fill.disable()
    assert fake_fill._fake == {}
