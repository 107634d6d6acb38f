"""Multi-node awareness on CPU: 4 and 8 gloo ranks simulating 2 nodes (``CP_OPS_NODE_ID`` per rank, set through
``cp_ops.config.configure(node_id=...)`` as a rank's environment would): the node identities, the rank contract's
shared-memory exchange only inside a node, ``transport='auto'`` taking a single-node transport only for a group on one
node, and 2-D attention whose rows are nodes (inner: the single-node transport, outer: torch) equal to one device."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cp_ops
from cp_ops import config, contract, layout, node
from cp_ops.transport import base
from dist_util import run_ranks
from pooled_transport import PooledTestTransport


class SingleNodeTestTransport(PooledTestTransport):
    """A CPU transport marked single-node (as the fast one is), in 'auto''s order before torch."""

    name = "single_node_test"
    single_node = True


def _install():
    t = base.register(SingleNodeTestTransport(), auto_rank=0)
    return t


def _two_nodes(rank, w):
    per = w // 2
    config.configure(node_id=f"node{rank // per}")
    _install()
    world = dist.group.WORLD
    ids = node.group_nodes(world)
    assert ids == tuple(f"node{r // per}" for r in range(w))
    assert node.layout(ids) == (2, per) and node.node_major(ids)
    assert not node.node_major(("a", "b", "a", "b"))
    with pytest.raises(ValueError, match="unevenly"):
        node.layout(("a", "a", "b"))

    mesh = init_device_mesh("cpu", (2, per), mesh_dim_names=("agkv", "ulysses"))
    outer, inner = mesh.get_group("agkv"), mesh.get_group("ulysses")
    h = 2 * per
    g = torch.Generator().manual_seed(w)
    q, k, v = (torch.randn(1, 4 * w, h, 8, generator=g) for _ in range(3))
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    full = sh(cp_ops.local_attention(q, k, v))

    # 'auto' over the whole world (2 nodes): torch on every rank; over a row (one node): the single-node transport
    assert base.for_group("auto", world, torch.device("cpu")).name == "torch"
    assert base.for_group("auto", inner, torch.device("cpu")).name == "single_node_test"
    assert base.for_group("auto", outer, torch.device("cpu")).name == "torch"
    out = cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", chunks=1)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    out = cp_ops.attention(sh(q), sh(k), sh(v), group=mesh)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)

    # the rank contract: shared memory only where the group is one node
    assert contract._groups[inner.group_name].shm is not None
    assert contract._groups[outer.group_name].shm is None
    assert contract._groups[world.group_name].shm is None


@pytest.mark.parametrize("world_size", [4, 8])
def test_two_simulated_nodes(world_size):
    run_ranks(_two_nodes, world_size)


def _one_node(rank, w):
    _install()  # no CP_OPS_NODE_ID: the host name, the same on every rank here
    assert node.group_nodes(dist.group.WORLD) == (node.node_id(),) * w
    assert base.for_group("auto", dist.group.WORLD, torch.device("cpu")).name == "single_node_test"
    q = torch.randn(1, 4, 2, 8)
    cp_ops.attention(q, q, q, mode="agkv", chunks=1)
    assert contract._groups[dist.group.WORLD.group_name].shm is not None


def test_one_node_uses_single_node_transport_and_shm():
    run_ranks(_one_node, 2)


def test_node_id_setting(monkeypatch):
    saved = config.snapshot()
    try:
        assert config.from_env({"CP_OPS_NODE_ID": "rack3-n7"}).node_id == "rack3-n7"
        config.configure(node_id="sim0")
        assert node.node_id() == "sim0"
        config.configure(node_id=None)
        import socket

        assert node.node_id() == socket.gethostname()
    finally:
        config.restore(saved)
