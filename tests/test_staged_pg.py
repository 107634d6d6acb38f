"""tests/staged_pg.py, the test-side ``'staged'`` backend (collectives staged through host memory onto gloo): on 2 CPU
ranks, every collective it implements — ``dist.*`` calls, point to point in either order, c10d functional collectives
eager and inside ``torch.compile`` — writes exactly (bitwise) what gloo writes for the same inputs, and went through
the staged group (its call counter moved)."""

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks


def _rand(rank, *shape, dtype=torch.float32, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(*shape, generator=g).to(dtype)


def _staged_group():
    import staged_pg

    staged_pg.register()
    return dist.new_group(backend="staged"), staged_pg.CALLS


def _same(kind, calls, before, got, want):
    assert calls[kind] > before, (kind, dict(calls))
    for g, w in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]):
        assert g.dtype == w.dtype and g.shape == w.shape, (kind, g.shape, w.shape)
        assert torch.equal(g, w), (kind, (g.float() - w.float()).abs().max())


def _collectives(rank, w):
    staged, calls = _staged_group()
    gloo = dist.group.WORLD
    assert dist.get_backend(staged) == "staged"

    def both(kind, make, call):
        """``call(group, *tensors)`` on fresh ``make()`` tensors for gloo and for the staged group: the tensors."""
        want, got = make(), make()
        call(gloo, *want)
        before = calls[kind]
        call(staged, *got)
        _same(kind, calls, before, [t for x in got for t in (x if isinstance(x, list) else [x])],
              [t for x in want for t in (x if isinstance(x, list) else [x])])

    for dt in (torch.float32, torch.bfloat16):
        x = _rand(rank, 6, 5, dtype=dt)
        both("allgather", lambda: ([torch.empty_like(x) for _ in range(w)],),
             lambda g, outs: dist.all_gather(outs, x, group=g))
        both("_allgather_base", lambda: (torch.empty(6 * w, 5, dtype=dt),),
             lambda g, out: dist.all_gather_into_tensor(out, x, group=g))
        both("alltoall_base", lambda: (torch.empty(6, 5, dtype=dt),),
             lambda g, out: dist.all_to_all_single(out, x, group=g))
    # uneven all-to-all: rank r sends (1 + r + j) rows to rank j
    x = _rand(rank, sum(1 + rank + j for j in range(w)), 3, salt=1)
    out_splits, in_splits = [1 + j + rank for j in range(w)], [1 + rank + j for j in range(w)]
    both("alltoall_base", lambda: (torch.empty(sum(out_splits), 3),),
         lambda g, out: dist.all_to_all_single(out, x, out_splits, in_splits, group=g))
    # list all-to-all (gloo has none: against the same exchange through gloo's all_to_all_single)
    ins = [_rand(rank, 2 + j, 4, salt=2 + j) for j in range(w)]
    outs = [torch.empty(2 + rank, 4) for _ in range(w)]
    before = calls["alltoall"]
    dist.all_to_all(outs, ins, group=staged)
    flat = torch.empty(w * (2 + rank) * 4)
    dist.all_to_all_single(flat, torch.cat([t.reshape(-1) for t in ins]), [(2 + rank) * 4] * w,
                           [t.numel() for t in ins], group=gloo)
    _same("alltoall", calls, before, outs, list(flat.view(w, 2 + rank, 4).unbind(0)))
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        both("allreduce", lambda: (_rand(rank, 7, 3, salt=3),), lambda g, t: dist.all_reduce(t, op=op, group=g))
    both("reduce", lambda: (_rand(rank, 7, 3, salt=3),), lambda g, t: dist.reduce(t, dst=1, group=g))
    both("broadcast", lambda: (_rand(rank, 4, 4, salt=4),), lambda g, t: dist.broadcast(t, src=1, group=g))
    x = _rand(rank, 4 * w, 3, salt=5)
    both("_reduce_scatter_base", lambda: (torch.empty(4, 3),),
         lambda g, out: dist.reduce_scatter_tensor(out, x, group=g))
    both("reduce_scatter", lambda: (torch.empty(4, 3),),
         lambda g, out: dist.reduce_scatter(out, list(x.chunk(w)), group=g))
    both("allreduce_coalesced", lambda: ([_rand(rank, 3, salt=12), _rand(rank, 2, 2, salt=13)],),
         lambda g, ts: (g if g is staged else g._get_backend(torch.device("cpu"))).allreduce_coalesced(ts).wait())
    both("gather", lambda: ([torch.empty(5) for _ in range(w)] if rank == 0 else [],),
         lambda g, outs: dist.gather(_rand(rank, 5, salt=6), outs or None, dst=0, group=g))
    both("scatter", lambda: (torch.empty(3),),
         lambda g, out: dist.scatter(out, [_rand(j, 3, salt=7) for j in range(w)] if rank == 0 else None, src=0,
                                     group=g))
    before = calls["barrier"]
    dist.barrier(group=staged)
    assert calls["barrier"] == before + 1


def test_collectives_equal_gloo():
    run_ranks(_collectives, 2)


def _point_to_point(rank, w):
    staged, calls = _staged_group()
    peer = 1 - rank
    mine = _rand(rank, 3, 4, salt=8)
    # blocking: rank 0 sends first, rank 1 receives first
    got = torch.empty(3, 4)
    if rank == 0:
        dist.send(mine, peer, group=staged)
        dist.recv(got, peer, group=staged)
    else:
        dist.recv(got, peer, group=staged)
        dist.send(mine, peer, group=staged)
    assert torch.equal(got, _rand(peer, 3, 4, salt=8))
    # batched, both ranks posting their receive first (a receive that waited at once would deadlock here)
    got = torch.empty(3, 4)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer, group=staged),
                                   dist.P2POp(dist.isend, mine * 2, peer, group=staged)])
    for r in reqs:
        r.wait()
    assert torch.equal(got, _rand(peer, 3, 4, salt=8) * 2)
    assert calls["send"] == 2 and calls["recv"] == 2, dict(calls)


def test_point_to_point_in_either_order():
    run_ranks(_point_to_point, 2)


def _functional(rank, w, compiled):
    import torch.distributed._functional_collectives as funcol

    staged, calls = _staged_group()
    gloo = dist.group.WORLD
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
    got = run(x, y, z, staged)
    kinds = {k: calls[k] - before.get(k, 0) for k in calls if calls[k] > before.get(k, 0)}
    assert kinds == {"allgather_into_tensor_coalesced": 2, "alltoall_base": 1, "allreduce": 1,
                     "reduce_scatter_tensor_coalesced": 1}, kinds
    for g, t in zip(got, want):
        assert g.shape == t.shape and torch.equal(g, t), (compiled, kinds, g.shape, t.shape)


@pytest.mark.parametrize("compiled", [None, "aot_eager"])
def test_functional_collectives_equal_gloo(compiled):
    run_ranks(_functional, 2, compiled)


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


def test_as_every_ranks_default_group():
    """``run_ranks(..., backend="staged")``: the default group is staged, and so are the groups made from it
    (``new_group``, a ``DeviceMesh``'s)."""
    run_ranks(_as_default, 2, backend="staged", timeout=120)
