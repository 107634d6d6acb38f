"""The cross-node split's route on gloo ranks (2 simulated nodes, CP_OPS_NODE_ID per rank; one node for W=2): ranks
that take different routes at a call raise ValueError on every rank at that call (never a wait that ends in a
timeout); equivalent spellings of ``comm_dtype`` take one route; a ``[B, S_total]`` key mask runs on the split's
mesh; the split's meshes are released with their flat group; ``init_cp_mesh`` reads CP_OPS_NETWORK_GBPS."""

import time

import pytest
import torch
import torch.distributed as dist

import cp_ops
from cp_ops import config, layout
from cp_ops.kernels import local_attention
from dist_util import run_ranks

TIMEOUT_S = 10  # a wait this long is the bug: the calls below answer in well under it


def _data(b, total, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, total, h, d, generator=g) for _ in range(3))


def _routes_differ(rank, w, nodes, other):
    config.configure(node_id=f"node{rank * nodes // w}", timeout_s=TIMEOUT_S)
    q, k, v = _data(1, 4 * w, 8, 8, seed=3)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    ref = sh(local_attention(q, k, v))
    # comm_dtype=q.dtype is comm_dtype=None: one route (the split's, on the group's first mode='auto' call), one result
    out = cp_ops.attention(sh(q), sh(k), sh(v), comm_dtype=q.dtype if rank == 1 else None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # a rank that names a mode (no split) beside ranks with mode='auto' (which runs another): ValueError on every rank,
    # at once
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="must make the same cp_ops calls"):
        cp_ops.attention(sh(q), sh(k), sh(v), chunks=1, mode=other if rank == w - 1 else "auto")
    assert time.monotonic() - t0 < TIMEOUT_S / 2, time.monotonic() - t0
    # FP8 on one rank only (it takes no split): the same
    with pytest.raises(ValueError, match="must make the same cp_ops calls"):
        cp_ops.attention(sh(q), sh(k), sh(v), chunks=2, comm_dtype=torch.float8_e4m3fn if rank == 0 else None)
    assert time.monotonic() - t0 < TIMEOUT_S / 2, time.monotonic() - t0
    # the group is still usable
    torch.testing.assert_close(cp_ops.attention(sh(q), sh(k), sh(v), chunks=1), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("w,nodes,other", [(2, 1, "ulysses"), (4, 2, "agkv")])  # 'auto' runs the other mode
def test_ranks_on_different_routes_raise_at_once(w, nodes, other):
    run_ranks(_routes_differ, w, nodes, other)


def _every_key_mask_on_the_mesh(rank, w):
    config.configure(node_id=f"node{rank // 2}", network_gbps=1e-3)  # a slow network: 4 does not divide 6 heads: 2x2
    b, s, h, d = 2, 5, 6, 8
    q, k, v = _data(b, s * w, h, d, seed=5)
    mask = torch.rand(b, s * w, generator=torch.Generator().manual_seed(6)) > 0.4
    mask[:, 0] = True
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    ref = sh(local_attention(q, k, v, None, mask))
    for _ in range(2):  # the plan's build, then the cached plan
        out = cp_ops.attention(sh(q), sh(k), sh(v), key_mask=mask)  # [B, S_total]: every key, the same on every rank
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    c = cp_ops.describe(sh(q), key_mask=mask)
    assert (c.mode, c.source) == ("agkv_ulysses", "cost"), c
    # the local [B, S_local] mask gives the same result
    torch.testing.assert_close(cp_ops.attention(sh(q), sh(k), sh(v), key_mask=sh(mask)), ref, rtol=1e-5, atol=1e-5)


def test_every_key_mask_on_the_splits_mesh():
    run_ranks(_every_key_mask_on_the_mesh, 4)


def _meshes_released(rank, w):
    from cp_ops import contract
    from cp_ops.plan import split

    config.configure(node_id=f"node{rank // 2}", network_gbps=1e-3)
    pg_map = dist.distributed_c10d._world.pg_map
    before = len(pg_map)
    g = dist.new_group(list(range(w)))
    q, k, v = (layout.shard(t, 1, rank, w) for t in _data(1, 4 * w, 6, 8, seed=7))
    cp_ops.attention(q, k, v, group=g)
    assert cp_ops.describe(q, group=g).mode == "agkv_ulysses"  # the split built its mesh: two groups more
    assert len(pg_map) == before + 3, (len(pg_map), before)
    dist.destroy_process_group(g)
    contract._forget_destroyed()  # what cp_ops does at its next exchange on a new group
    assert len(pg_map) == before, (len(pg_map), before)
    assert not split._meshes


def test_the_splits_meshes_go_with_their_group():
    run_ranks(_meshes_released, 4)


def _init_mesh_reads_network(rank, w):
    from cp_ops.mesh import init_cp_mesh
    from cp_ops.plan import split

    # 2 nodes x 2, 6 heads: at the default 50 GB/s the 2x2 mesh; a network as fast as NVLink: pure AGKV (4x1)
    config.configure(node_id=f"n{rank // 2}", network_gbps=345.0)
    mesh, p = init_cp_mesh(256, 6, 1024, dtype="fp32", batch=2, device_type="cpu")
    assert (p.outer, p.inner) == (4, 1), p
    s = split.choose(("n0", "n0", "n1", "n1"), 2, 64, 6, 1024, "fp32")
    assert (s.outer, s.inner) == (p.outer, p.inner), (s, p)  # one cost model, one setting
    dist.barrier()


def test_init_cp_mesh_reads_the_network_setting():
    run_ranks(_init_mesh_reads_network, 4)
