"""mode='auto' on a flat group across simulated nodes (cp_ops.plan.split): the cost model's choice on hand-checked cases
(pure), and on gloo ranks (2 nodes x 2 and 2 x 4, CP_OPS_NODE_ID per rank) the split each call runs, equal to the
same SDPA calls bitwise (1 stage) and to one device within rounding; cp_ops.describe names the split and its numbers."""

import pytest
import torch
import torch.distributed as dist

import cp_ops
from cp_ops import config, layout
from cp_ops.plan import split
from cp_ops.kernels import local_attention
from dist_util import run_ranks

TWO_BY_TWO = ("n0", "n0", "n1", "n1")
TWO_BY_FOUR = ("n0",) * 4 + ("n1",) * 4


def test_choice_on_hand_checked_cases():
    # one node: the 1-D heuristic decides (no split)
    assert split.choose(("a",) * 4, 1, 16, 4, 8) is None
    # tiny calls are latency-bound: one collective (pure AGKV, 0.03 ms) beats Ulysses' two (0.06) and 2x2's three
    s = split.choose(TWO_BY_TWO, 1, 16, 4, 8, "fp32")
    assert (s.mode, s.shape, s.source) == ("agkv", "4x1", "cost"), s
    assert "agkv 0.030, ulysses 0.060, 2x2 0.070 -> agkv" in s.why, s.why
    # 6 heads (4 does not divide them), L = 2*64*6*1024*4 B = 3.1 MB: AGKV sends 4L over the network, 2x2 2L
    s = split.choose(TWO_BY_TWO, 2, 64, 6, 1024, "fp32")
    assert (s.mode, s.outer, s.inner) == ("agkv_ulysses", 2, 2), s
    # 4 heads: pure Ulysses sends 2L over the network too, in two collectives and no in-node all-to-all: Ulysses
    assert split.choose(TWO_BY_TWO, 2, 64, 4, 1024, "fp32").mode == "ulysses"
    # 2 nodes x 4, 12 heads (8 does not divide them): Ulysses over each node, AGKV across (2x4)
    s = split.choose(TWO_BY_FOUR, 1, 32, 12, 1024, "fp32")
    assert (s.mode, s.shape) == ("agkv_ulysses", "2x4"), s
    # 6 heads: the inner size must divide 6 -> 4x2 (two rows per node)
    assert split.choose(TWO_BY_FOUR, 4, 256, 6, 512, "fp32").shape == "4x2"
    # uneven nodes or ranks not numbered node by node: the 1-D heuristic, said why
    s = split.choose(("a", "b", "a", "b"), 2, 64, 6, 1024, "fp32")
    assert s.source == "heuristic" and "not numbered node by node" in s.why, s
    s = split.choose(("a", "a", "a", "b"), 2, 64, 6, 1024, "fp32")
    assert s.source == "heuristic" and "unevenly" in s.why, s
    # CP_OPS_NETWORK_GBPS: a network as fast as NVLink leaves latency to decide: one collective (pure AGKV) wins
    saved = config.snapshot()
    try:
        config.configure(network_gbps=345.0)
        s = split.choose(TWO_BY_TWO, 2, 64, 6, 1024, "fp32")
        assert (s.mode, s.shape) == ("agkv", "4x1") and "network 345 GB/s" in s.why, s
    finally:
        config.restore(saved)
    # the same inputs give the same answer (no timing)
    assert split.choose(TWO_BY_FOUR, 1, 32, 12, 1024, "fp32") == split.choose(TWO_BY_FOUR, 1, 32, 12, 1024, "fp32")


def _data(b, total, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, total, h, d, generator=g) for _ in range(3))


def _rows_ref(q, k, v, outer, inner, rank, w):
    """One device with the SDPA calls a 2-D O x I call makes: per head group of the inner size, the queries of this
    rank's row against every key; this rank's rows."""
    s = q.shape[1] // w
    o = rank // inner
    lo, hi = o * inner * s, (o + 1) * inner * s
    hl = q.shape[2] // inner
    row = torch.cat([local_attention(q[:, lo:hi, g * hl:(g + 1) * hl], k[:, :, g * hl:(g + 1) * hl],
                                     v[:, :, g * hl:(g + 1) * hl]) for g in range(inner)], dim=2)
    return row[:, rank * s - lo:(rank + 1) * s - lo]


def _auto_across_nodes(rank, w, cases, compiled):
    per = w // 2
    config.configure(node_id=f"node{rank // per}")
    if compiled:  # one rank's first call of a shape differs: every rank takes the 1-D path and raises, none waits
        q = torch.randn(1, 3 if rank == 1 else 4, 6, 8)
        with pytest.raises(ValueError):
            cp_ops.attention(q, q, q)
    for b, s, h, d, want in cases:
        q, k, v = _data(b, s * w, h, d, seed=100 * w + h)
        sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
        before = cp_ops.describe(sh(q))
        out = cp_ops.attention(sh(q), sh(k), sh(v))  # mode='auto', chunks=None
        c = cp_ops.describe(sh(q))
        assert c.source == "cost" and "cost model" in c.why, (before, c)
        if want == "agkv" and b == 1 and w == 8:  # the group's first auto call learns its nodes: describe before it
            assert before.source == "heuristic", before  # answers as for one node
        if want == "agkv":
            assert c.mode == "agkv" and c.chunks == 1, c
            same = local_attention(sh(q), k, v)
        elif want == "ulysses":
            assert c.mode == "ulysses", c
            same = _rows_ref(q, k, v, 1, w, rank, w)
        else:
            o, i = (int(x) for x in want.split("x"))
            assert c.mode == "agkv_ulysses" and f"-> {want}" in c.why, c
            same = _rows_ref(q, k, v, o, i, rank, w)
            mesh = split.mesh_of(dist.group.WORLD.group_name, o, i, "cpu")
            assert tuple(mesh.shape) == (o, i) and mesh.mesh_dim_names == ("agkv", "ulysses")
            row = dist.get_process_group_ranks(mesh.get_group("ulysses"))
            assert row == list(range((rank // i) * i, (rank // i + 1) * i)), row  # inner = ranks of a node (part)
        assert torch.equal(out, same), (want, (out - same).abs().max().item())  # 1 stage: bitwise
        torch.testing.assert_close(out, sh(local_attention(q, k, v)), rtol=1e-5, atol=1e-5)
        # a repeat call (the cached split, the eager plan) on fresh data
        q, k, v = _data(b, s * w, h, d, seed=7)
        torch.testing.assert_close(cp_ops.attention(sh(q), sh(k), sh(v)), sh(local_attention(q, k, v)),
                                   rtol=1e-5, atol=1e-5)
    if not compiled:
        return
    # traced by Dynamo (fullgraph; no Inductor: seconds on CI): the split is decided while tracing, as eager's
    b, s, h, d, want = cases[1]
    q, k, v = _data(b, s * w, h, d, seed=9)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    f = torch.compile(lambda a, b_, c: cp_ops.attention(a, b_, c), fullgraph=True, backend="eager")  # Dynamo only
    assert torch.equal(f(sh(q), sh(k), sh(v)), cp_ops.attention(sh(q), sh(k), sh(v)))
    # dynamic shapes: the split needs the sizes, so they are specialized (a guard; not a graph break)
    torch._dynamo.reset()
    f = torch.compile(lambda a, b_, c: cp_ops.attention(a, b_, c), fullgraph=True, backend="eager", dynamic=True)
    torch.testing.assert_close(f(sh(q), sh(k), sh(v)), sh(local_attention(q, k, v)), rtol=1e-5, atol=1e-5)


def test_auto_on_two_nodes_of_two():
    # tiny: agkv; 6 heads, 1.6 MB per local tensor: 2x2; 4 heads: ulysses
    run_ranks(_auto_across_nodes, 4, [(1, 4, 4, 8, "agkv"), (1, 64, 6, 1024, "2x2"), (1, 64, 4, 1024, "ulysses")], True)


def test_auto_on_two_nodes_of_four():
    run_ranks(_auto_across_nodes, 8, [(1, 4, 4, 8, "agkv"), (1, 32, 12, 1024, "2x4")], False)
