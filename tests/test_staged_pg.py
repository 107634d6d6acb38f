"""tests/staged_pg.py, the test-side ``'staged'`` backend (collectives staged through host memory onto gloo): on 2
ranks, every collective it implements — ``dist.*`` calls, point to point in either order, c10d functional collectives
eager and inside ``torch.compile`` — writes exactly (bitwise) what gloo writes on CPU tensors for the same inputs, and
went through the staged group (its call counter moved). On CPU ranks (the staged group made beside gloo's default)
and, marked gpu, on two ranks sharing one GPU with CUDA tensors (the staged group as the default, gloo beside it)."""

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks

on_one_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _rand(rank, *shape, dtype=torch.float32, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(*shape, generator=g).to(dtype)


def _groups(on_gpu: bool):
    """(the staged group, a gloo group over the same ranks, the staged calls' device, the call counter): on CPU
    ranks a staged group beside gloo's default; on one GPU (``run_ranks(..., backend="staged")``) the default."""
    import staged_pg

    staged_pg.register()
    if on_gpu:
        staged, gloo, dev = dist.group.WORLD, dist.new_group(backend="gloo"), torch.device("cuda", 0)
    else:
        staged, gloo, dev = dist.new_group(backend="staged"), dist.group.WORLD, torch.device("cpu")
    assert dist.get_backend(staged) == "staged"
    return staged, gloo, dev, staged_pg.CALLS


def _to(x, dev):
    """``x`` (a tensor or nested lists of them) on ``dev``: fresh copies."""
    if isinstance(x, torch.Tensor):
        return x.to(dev, copy=True)
    return [_to(v, dev) for v in x]


def _flat(x):
    return [x] if isinstance(x, torch.Tensor) else [t for v in x for t in _flat(v)]


def _same(kind, calls, before, got, want):
    assert calls[kind] > before, (kind, dict(calls))
    for g, w in zip(_flat(got), _flat(want), strict=True):
        g = g.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape, (kind, g.shape, w.shape)
        assert torch.equal(g, w), (kind, (g.float() - w.float()).abs().max())


def _collectives(rank, w, on_gpu=False):
    staged, gloo, dev, calls = _groups(on_gpu)
    cpu = torch.device("cpu")

    def both(kind, make, call):
        """``call(group, device, *tensors)`` on gloo with ``make()``'s CPU tensors and on the staged group with copies
        of them on ``dev``: the same tensors after."""
        want = make()
        got = _to(want, dev)
        call(gloo, cpu, *want)
        before = calls[kind]
        call(staged, dev, *got)
        _same(kind, calls, before, got, want)

    for dt in (torch.float32, torch.bfloat16):
        x = _rand(rank, 6, 5, dtype=dt)
        both("allgather", lambda: ([torch.empty_like(x) for _ in range(w)],),
             lambda g, d, outs: dist.all_gather(outs, x.to(d), group=g))
        both("_allgather_base", lambda: (torch.empty(6 * w, 5, dtype=dt),),
             lambda g, d, out: dist.all_gather_into_tensor(out, x.to(d), group=g))
        both("alltoall_base", lambda: (torch.empty(6, 5, dtype=dt),),
             lambda g, d, out: dist.all_to_all_single(out, x.to(d), group=g))
    # uneven all-to-all: rank r sends (1 + r + j) rows to rank j
    x = _rand(rank, sum(1 + rank + j for j in range(w)), 3, salt=1)
    out_splits, in_splits = [1 + j + rank for j in range(w)], [1 + rank + j for j in range(w)]
    both("alltoall_base", lambda: (torch.empty(sum(out_splits), 3),),
         lambda g, d, out: dist.all_to_all_single(out, x.to(d), out_splits, in_splits, group=g))
    # list all-to-all (gloo has none: against the same exchange through gloo's all_to_all_single)
    ins = [_rand(rank, 2 + j, 4, salt=2 + j) for j in range(w)]
    outs = [torch.empty(2 + rank, 4, device=dev) for _ in range(w)]
    before = calls["alltoall"]
    dist.all_to_all(outs, _to(ins, dev), group=staged)
    flat = torch.empty(w * (2 + rank) * 4)
    dist.all_to_all_single(flat, torch.cat([t.reshape(-1) for t in ins]), [(2 + rank) * 4] * w,
                           [t.numel() for t in ins], group=gloo)
    _same("alltoall", calls, before, outs, list(flat.view(w, 2 + rank, 4).unbind(0)))
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        both("allreduce", lambda: (_rand(rank, 7, 3, salt=3),), lambda g, d, t: dist.all_reduce(t, op=op, group=g))
    both("reduce", lambda: (_rand(rank, 7, 3, salt=3),), lambda g, d, t: dist.reduce(t, dst=1, group=g))
    both("broadcast", lambda: (_rand(rank, 4, 4, salt=4),), lambda g, d, t: dist.broadcast(t, src=1, group=g))
    x = _rand(rank, 4 * w, 3, salt=5)
    both("_reduce_scatter_base", lambda: (torch.empty(4, 3),),
         lambda g, d, out: dist.reduce_scatter_tensor(out, x.to(d), group=g))
    both("reduce_scatter", lambda: (torch.empty(4, 3),),
         lambda g, d, out: dist.reduce_scatter(out, list(x.to(d).chunk(w)), group=g))
    both("allreduce_coalesced", lambda: ([_rand(rank, 3, salt=12), _rand(rank, 2, 2, salt=13)],),
         lambda g, d, ts: (g if g is staged else g._get_backend(cpu)).allreduce_coalesced(ts).wait())
    both("gather", lambda: ([torch.empty(5) for _ in range(w)] if rank == 0 else [],),
         lambda g, d, outs: dist.gather(_rand(rank, 5, salt=6).to(d), outs or None, dst=0, group=g))
    both("scatter", lambda: (torch.empty(3),),
         lambda g, d, out: dist.scatter(out, [_rand(j, 3, salt=7).to(d) for j in range(w)] if rank == 0 else None,
                                        src=0, group=g))
    before = calls["barrier"]
    dist.barrier(group=staged)
    assert calls["barrier"] == before + 1


def test_collectives_equal_gloo():
    run_ranks(_collectives, 2)


@pytest.mark.parametrize("_", [pytest.param(None, marks=on_one_gpu)])
def test_collectives_on_one_gpu_equal_gloo(_):
    run_ranks(_collectives, 2, True, device="one_gpu", backend="staged", timeout=120)


def _point_to_point(rank, w, on_gpu=False):
    staged, _, dev, calls = _groups(on_gpu)
    peer = 1 - rank
    mine = _rand(rank, 3, 4, salt=8).to(dev)
    # blocking: rank 0 sends first, rank 1 receives first
    got = torch.empty(3, 4, device=dev)
    if rank == 0:
        dist.send(mine, peer, group=staged)
        dist.recv(got, peer, group=staged)
    else:
        dist.recv(got, peer, group=staged)
        dist.send(mine, peer, group=staged)
    assert torch.equal(got.cpu(), _rand(peer, 3, 4, salt=8))
    # batched, both ranks posting their receive first (a receive that waited at once would deadlock here)
    got = torch.empty(3, 4, device=dev)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer, group=staged),
                                   dist.P2POp(dist.isend, mine * 2, peer, group=staged)])
    for r in reqs:
        r.wait()
    assert torch.equal(got.cpu(), _rand(peer, 3, 4, salt=8) * 2)
    assert calls["send"] == 2 and calls["recv"] == 2, dict(calls)


def test_point_to_point_in_either_order():
    run_ranks(_point_to_point, 2)


@pytest.mark.parametrize("_", [pytest.param(None, marks=on_one_gpu)])
def test_point_to_point_on_one_gpu(_):
    run_ranks(_point_to_point, 2, True, device="one_gpu", backend="staged", timeout=120)


def _functional(rank, w, compiled, on_gpu=False):
    import torch.distributed._functional_collectives as funcol

    staged, gloo, dev, calls = _groups(on_gpu)
    out_splits, in_splits = [1 + j + rank for j in range(w)], [1 + rank + j for j in range(w)]

    def fn(x, y, z, group):
        a = funcol.all_gather_tensor(x, 0, group)
        b = funcol.all_to_all_single(y, out_splits, in_splits, group)
        c = funcol.all_reduce(z, "sum", group)
        d = funcol.reduce_scatter_tensor(z, "sum", 0, group)
        # a gather along another dim (gathered, then moved; torch 2.11's Dynamo refuses to trace the move)
        e = funcol.all_gather_tensor(x, 0 if compiled else 1, group)
        return [funcol.wait_tensor(t) * 1 for t in (a, b, c, d, e)]

    x = _rand(rank, 3, 5, dtype=torch.bfloat16, salt=9)
    y = _rand(rank, sum(in_splits), 4, salt=10)
    z = _rand(rank, 2 * w, 3, salt=11)
    want = fn(x, y, z, gloo)
    run = torch.compile(fn, backend=compiled, fullgraph=True) if compiled else fn
    before = dict(calls)
    got = run(*_to([x, y, z], dev), staged)
    kinds = {k: calls[k] - before.get(k, 0) for k in calls if calls[k] > before.get(k, 0)}
    assert kinds == {"allgather_into_tensor_coalesced": 2, "alltoall_base": 1, "allreduce": 1,
                     "reduce_scatter_tensor_coalesced": 1}, kinds
    for g, t in zip(got, want, strict=True):
        assert g.device == dev and g.shape == t.shape and torch.equal(g.cpu(), t), (compiled, g.shape, t.shape)


@pytest.mark.parametrize("compiled", [None, "aot_eager"])
def test_functional_collectives_equal_gloo(compiled):
    run_ranks(_functional, 2, compiled)


@pytest.mark.parametrize("compiled", [pytest.param(c, marks=on_one_gpu) for c in (None, "aot_eager")])
def test_functional_collectives_on_one_gpu_equal_gloo(compiled):
    run_ranks(_functional, 2, compiled, True, device="one_gpu", backend="staged", timeout=120)


def _as_default(rank, w):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh

    import staged_pg

    assert dist.get_backend() == "staged"
    gloo = dist.new_group(backend="gloo")
    sub = dist.new_group()  # a group made from the default: staged too
    mesh = DeviceMesh("cpu", torch.arange(w).view(1, w), mesh_dim_names=("ring", "ulysses"))
    assert dist.get_backend(sub) == "staged" and isinstance(mesh.get_group("ulysses"), staged_pg.StagedGroup)
    x = _rand(rank, 4, 3, salt=14)
    want = funcol.all_to_all_single(x, None, None, gloo).wait()
    for g in (dist.group.WORLD, sub, mesh.get_group("ulysses")):
        before = staged_pg.CALLS["alltoall_base"]
        got = funcol.wait_tensor(funcol.all_to_all_single(x, None, None, g))
        _same("alltoall_base", staged_pg.CALLS, before, got, want)


@pytest.mark.parametrize("_", [pytest.param(None, marks=on_one_gpu)])
def test_as_every_ranks_default_group(_):
    """``run_ranks(..., backend="staged")``: the default group is staged, and so are the groups made from it
    (``new_group``, a ``DeviceMesh``'s). On one GPU only, where the peers' check uses it: a staged default group means
    spawned ranks (two interpreter starts), the collectives themselves are checked on CPU ranks above."""
    run_ranks(_as_default, 2, device="one_gpu", backend="staged", timeout=120)
