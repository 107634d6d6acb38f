"""The cost model (cp_ops.cost): bytes per link by hand on a few layouts, the choice on hand-checked cases, and
cp_ops.mesh.init_cp_mesh building the chosen mesh on 4 gloo ranks simulating 2 nodes."""

import pytest
import torch
import torch.distributed as dist

from cp_ops import config, cost
from dist_util import run_ranks

WAN14B = dict(tokens=75600, heads=40, head_dim=128)


def _by_name(preds):
    return {p.name: p for p in preds}


def test_bytes_by_hand():
    links = cost.Links()
    preds = _by_name(cost.predict(**WAN14B, ranks_per_node=8, nodes=1))
    local = 75600 / 8 * 40 * 128 * 2  # one local tensor, bytes
    u = preds["ulysses"]
    assert u.outer == 1 and u.inner == 8
    assert u.nvlink_mb == pytest.approx(4 * local * 7 / 8 / 1e6) and u.network_mb == 0
    a = preds["agkv"]
    assert a.nvlink_mb == pytest.approx(2 * local * 7 / 1e6) and a.network_mb == 0
    assert a.comm_ms == pytest.approx(links.nvlink_latency_ms + 2 * local * 7 / (links.nvlink_gbps * 1e6))
    attn = 4 * (75600 / 8) * 75600 * 40 * 128 / (links.attn_tflops * 1e12) * 1e3
    assert u.attn_ms == pytest.approx(attn)
    assert "2x4" in preds and "4x2" in preds and preds["ring"].network_mb == 0
    # two nodes of 8: the 2x8 split keeps the all-to-all on NVLink and sends one row's K/V over the network
    preds = _by_name(cost.predict(**WAN14B, ranks_per_node=8, nodes=2))
    local = 75600 / 16 * 40 * 128 * 2
    p = preds["2x8"]
    assert p.nvlink_mb == pytest.approx(4 * local * 7 / 8 / 1e6)
    assert p.network_mb == pytest.approx(2 * local / 1e6)
    flat = preds["agkv"]  # 16x1: 7 peers on the node, 8 across the network
    assert flat.nvlink_mb == pytest.approx(2 * local * 7 / 1e6) and flat.network_mb == pytest.approx(2 * local * 8 / 1e6)
    assert "ulysses" not in preds  # 16 does not divide 40 heads
    # 4x4 on 2 nodes of 8: inner inside a node, outer of 4 with 2 on this node
    p = preds["4x4"]
    assert p.network_mb == pytest.approx(2 * local * 2 / 1e6) and p.nvlink_mb == pytest.approx(
        (4 * local * 3 / 4 + 2 * local) / 1e6)


def test_choice_on_hand_checked_cases():
    # one node of 8, 40 heads: Ulysses moves 3.5 local tensors, AGKV 14: Ulysses
    assert cost.choose(**WAN14B, ranks_per_node=8, nodes=1).name == "ulysses"
    # two ranks: equal bytes, Ulysses pays two collectives: AGKV (as cp_ops.modes.choose)
    assert cost.choose(4096, 40, 128, ranks_per_node=2, nodes=1).name == "agkv"
    # 2 nodes x 8, 40 heads: Ulysses inside the node, AGKV across: 2x8
    assert cost.choose(**WAN14B, ranks_per_node=8, nodes=2).name == "2x8"
    # 3 heads on a node of 4: nothing but AGKV divides
    assert cost.choose(8192, 3, 64, ranks_per_node=4, nodes=1).name == "agkv"
    # a network as fast as NVLink and no latency difference: the fewest bytes win (the flat Ulysses where possible)
    fast = cost.Links(network_gbps=345.0, network_latency_ms=0.02)
    assert cost.choose(32768, 32, 128, ranks_per_node=8, nodes=2, links=fast).name == "ulysses"
    with pytest.raises(ValueError, match="dtype must be one of"):
        cost.predict(100, 4, 8, ranks_per_node=2, dtype="int4")
    with pytest.raises(ValueError, match="must be >= 1"):
        cost.predict(100, 4, 8, ranks_per_node=0)


def _init_mesh(rank, w):
    from cp_ops.mesh import init_cp_mesh

    config.configure(node_id=f"n{rank // 2}")
    mesh, p = init_cp_mesh(75600, 6, 128, device_type="cpu")  # 4 does not divide 6 heads: 2x2 (network 2L) vs 4x1 (4L)
    assert (p.outer, p.inner) == (2, 2) and mesh.mesh_dim_names == ("agkv", "ulysses")
    assert tuple(mesh.shape) == (2, 2)
    assert dist.get_process_group_ranks(mesh.get_group("ulysses")) == [2 * (rank // 2), 2 * (rank // 2) + 1]


def test_init_cp_mesh_two_simulated_nodes():
    run_ranks(_init_mesh, 4)


def _init_mesh_not_node_major(rank, w):
    from cp_ops.mesh import init_cp_mesh

    config.configure(node_id=f"n{rank % 2}")
    with pytest.raises(ValueError, match="numbered node by node"):
        init_cp_mesh(4096, 4, 8, device_type="cpu")
    # every rank is past the node agreement before any leaves (rank 0 hosts the store: leaving first reset the
    # others' connections while they still read the agreed identities)
    dist.barrier()


def test_init_cp_mesh_refuses_interleaved_nodes():
    run_ranks(_init_mesh_not_node_major, 4)
