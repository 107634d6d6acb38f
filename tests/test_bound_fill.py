"""cp_ops.cli.bound_fill: the bound tool's fake groups write their collectives' outputs (this rank's data in every
slot), whatever torch's fake backend writes; cp_ops itself is not told. Outputs start as NaN and must end equal to
this rank's own data in every slot (fresh random inputs, never zeros)."""

import pytest
import torch
import torch.distributed as dist

from cp_ops.cli import bound_fill
from cp_ops.transport.torch import TorchTransport


@pytest.fixture
def filled4():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with bound_fill.filled():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_filled_groups_are_fake_groups_only_inside(filled4):
    """Groups made inside filled() write; they still report backend 'fake' (cp_ops treats them as any fake group);
    torch's creator is back afterwards."""
    assert bound_fill.is_filled(filled4) and dist.get_backend(filled4) == "fake"
    assert filled4._get_backend(torch.device("cpu")).supports_coalescing is False  # torch's fake backend under it
    outside = dist.new_group([0, 1])
    assert not bound_fill.is_filled(outside) and dist.get_backend(outside) == "fake"
    with bound_fill.filled():
        inside = dist.new_group([0, 1])
    assert bound_fill.is_filled(inside) and inside.size() == 2


@pytest.mark.parametrize("kind", ["alltoall_base", "_allgather_base", "allgather_into_tensor_coalesced", "recv"])
def test_each_collective_writes_own_data_in_every_slot(filled4, kind):
    inp = torch.randn(3, 5, 2)
    out = torch.full((3, 5, 2) if kind in ("alltoall_base", "recv") else (12, 5, 2), float("nan"))
    with bound_fill.recording() as rec:
        if kind == "alltoall_base":
            filled4.alltoall_base(out, inp, [], []).wait()
        elif kind == "_allgather_base":
            filled4._allgather_base(out, inp).wait()
        elif kind == "allgather_into_tensor_coalesced":
            filled4.allgather_into_tensor_coalesced([out], [inp]).wait()
        else:
            filled4.send([inp], 1, 7).wait()
            filled4.recv([out], 3, 7).wait()
    want = inp if kind in ("alltoall_base", "recv") else inp.repeat(4, 1, 1)
    assert torch.equal(out, want) and (out != 0).all()
    assert [r[0] for r in rec] == [kind] and rec[0][1] == tuple(out.shape) and rec[0][2] == tuple(inp.shape)


def test_transport_sites_write_real_data(filled4):
    """The torch transport's AGKV all-gather, its point-to-point gather, Ulysses' two all-to-alls and the comm's
    mask gather: every output is this rank's data, none NaN or stale."""
    from cp_ops import layout
    from cp_ops.comm import DirectComm

    t = TorchTransport()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 4, 4, 8, generator=g), torch.randn(2, 4, 4, 8, generator=g)
    with bound_fill.recording() as rec:
        kf, vf, _ = t.agkv_start(k, v, filled4)
        kp, vp, _, _ = t.agkv_start_sources(k, v, filled4, pieces=2)
        buf, _ = t.ulysses_start([k, v], filled4)
        inv, _ = t.ulysses_inverse_start(k, filled4)
        mask = (torch.rand(2, 4, generator=g) > 0.3).to(torch.uint8)
        mf = DirectComm(filled4, t).mask(mask).wait()
    for full, x in ((kf, k), (vf, v)):
        assert torch.equal(full, x.repeat(1, 4, 1, 1))
    for full, x in ((kp, k), (vp, v)):  # the peers' blocks (this rank's own block is the caller's to write)
        blocks = full.view(2, 4, 4, 4, 8)
        assert all(torch.equal(blocks[:, j], x) for j in range(1, 4))
    assert torch.equal(buf, layout.ulysses_pack([k, v], 4))
    assert torch.equal(inv, layout.ulysses_inverse_pack(k, 4))
    assert torch.equal(mf, mask.repeat(4, 1))
    kinds = [r[0] for r in rec]
    assert kinds.count("allgather_into_tensor_coalesced") == 4
    assert kinds.count("recv") == 3 * 2 * 2 * 2  # peers x pieces x (k, v) x batch rows
    assert kinds.count("alltoall_base") == 2 and kinds.count("_allgather_base") == 1


def test_functional_collectives_write_eager_and_compiled(filled4):
    """diffusers' path (functional collectives), eager and inside a torch.compile graph: written at run time."""
    import torch.distributed._functional_collectives as funcol

    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    with bound_fill.recording() as rec:
        a2a = funcol.wait_tensor(funcol.all_to_all_single(x, None, None, filled4))
        uneven = funcol.wait_tensor(funcol.all_to_all_single(x, [3, 3, 3, 3], [2, 2, 2, 2], filled4))
        gathered = funcol.wait_tensor(gather(x, gather_dim=1, group=filled4))
        # the group's size read inside the traced function, as cp_ops' planning does (Dynamo < 2.13 takes only
        # exact ProcessGroup classes unless the tool widens its check)
        compiled = torch.compile(lambda t: funcol.wait_tensor(gather(t * filled4.size(), gather_dim=0, group=filled4))
                                 + 1, backend="inductor", fullgraph=True)(x)
    assert torch.equal(a2a, x) and torch.equal(gathered, torch.cat([x] * 4, dim=1))
    assert uneven.shape == (12, 3) and torch.equal(uneven.reshape(-1)[:24], x.reshape(-1))
    assert torch.equal(compiled, (x * 4).repeat(4, 1) + 1)
    assert len(rec) == 4


def test_parallelized_model_outputs_real_data(filled4):
    """A tiny Wan parallelized over the filled group (Ulysses at W = 4): rank 0's forward output is finite, every
    write recorded (the attention's all-to-alls and the output gather) and replayed alone."""
    from cp_ops.cli.bound_sides import shared_copy
    from cp_ops.cli.models import MODELS, build
    from cp_ops.integrations.diffusers import parallelize

    spec = MODELS["wan"]
    model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    g = torch.Generator().manual_seed(1)
    kw = spec.make_inputs(cfg, 16, 1, 2, 16, 16, torch.device("cpu"), torch.float32, g)
    m = shared_copy(model)
    parallelize(m, filled4, mode="ulysses", transport="torch")
    with bound_fill.recording() as rec, torch.no_grad():
        out = spec.predict(m, kw)
    assert out.shape == spec.predict(model, kw).shape and torch.isfinite(out).all()
    kinds = {r[0] for r in rec}
    assert {"alltoall_base", "allgather_into_tensor_coalesced"} <= kinds  # functional gathers are coalesced ones
    assert bound_fill.replay_ms(rec, torch.device("cpu")) > 0
    with pytest.raises(RuntimeError, match="graphed=True needs a CUDA device; got cpu"):
        bound_fill.replay_ms(rec, torch.device("cpu"), graphed=True)


def test_unfilled_groups_are_torchs():
    """fake_groups(filled=False) (--unwritten): torch's own fake groups, nothing written by the tool."""
    from cp_ops.cli.bound import fake_groups

    try:
        groups = fake_groups([1, 2], filled=False)
        out = torch.full((4,), float("nan"))
        with bound_fill.recording() as rec:
            groups[2].alltoall_base(out, torch.randn(4), [], []).wait()
        assert rec == [] and not any(bound_fill.is_filled(g) for g in groups.values())
    finally:
        dist.destroy_process_group()
