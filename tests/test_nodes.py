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
    # init_cp_mesh with arguments that differ by rank: ValueError on every rank (was: each rank built the mesh its own
    # arguments chose, e.g. 2x1 on one rank and 1x2 on the other, and the first attention call failed on the modes)
    from cp_ops.mesh import init_cp_mesh

    with pytest.raises(ValueError, match=r"same arguments.*rank 0: tokens=4096, heads=7,.*rank 1: tokens=4096, "
                                         r"heads=24"):
        init_cp_mesh(4096, 7 if rank == 0 else 24, 128, device_type="cpu")
    m, p = init_cp_mesh(4096, 24, 128, device_type="cpu")
    assert tuple(m.shape) == (p.outer, p.inner) and p.outer * p.inner == w


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


def _regroup(rank, w, store_path):
    config.configure(node_id=f"n{rank}")
    assert node.group_nodes(dist.group.WORLD) == ("n0", "n1")
    dist.destroy_process_group()
    # a new default group (torch gives it the old one's name) whose ranks now share a node
    dist.init_process_group("gloo", store=dist.FileStore(store_path, w), rank=rank, world_size=w)
    config.configure(node_id="same")
    assert node.group_nodes(dist.group.WORLD) == ("same", "same")  # was ('n0', 'n1'): the old group's answer


def test_group_nodes_asks_a_new_group_under_an_old_name(tmp_path):
    """node.group_nodes cached by group name answered a new group (after destroy_process_group and a new init, torch
    reuses the name) with the destroyed group's node identities (init_cp_mesh, the cost model then saw wrong nodes)."""
    run_ranks(_regroup, 2, str(tmp_path / "store"))


def test_node_id_refuses_control_characters():
    """A tab in CP_OPS_NODE_ID broke the ranks' tab-separated identity records at the first call ('too many values to
    unpack (expected 5)', no rule named); now refused where it is read. Blank = unset (the host name)."""
    saved = config.snapshot()
    try:
        for bad in ("n\t0", "a\nb", "x\ry"):
            with pytest.raises(config.ConfigError, match=r"CP_OPS_NODE_ID=.* must be printable text"):
                config.from_env({"CP_OPS_NODE_ID": bad})
            with pytest.raises(config.ConfigError, match="must be printable text"):
                config.configure(node_id=bad)
        assert config.from_env({"CP_OPS_NODE_ID": "  rack 3/n7\t"}).node_id == "rack 3/n7"
        assert config.from_env({"CP_OPS_NODE_ID": ""}).node_id is None
        config.configure(node_id=" ")
        import socket

        assert node.node_id() == socket.gethostname()
    finally:
        config.restore(saved)


def test_torchrun_two_simulated_nodes(tmp_path):
    """The multi-node launch: two ``torchrun --nnodes 2`` agents (one per simulated node, c10d rendezvous, each with its
    own CP_OPS_NODE_ID) run the 2-D example on 2 × 2 CPU ranks; the ranks see 2 nodes and match one device."""
    import os
    import subprocess
    import sys

    from cp_ops.cli.launch import free_port

    port = free_port()
    env = dict(os.environ, CP_OPS_TIMEOUT_S="60", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "cp_ops.examples.attention_2d",
           "--device", "cpu", "--tokens", "64", "--heads", "6", "--head-dim", "8", "--mesh", "2x2"]
    procs = [subprocess.Popen(cmd[:3] + ["--node-rank", str(n)] + cmd[3:], env=dict(env, CP_OPS_NODE_ID=f"node{n}"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert all(p.returncode == 0 for p in procs), outs
    assert "2 node(s) x 2 rank(s) (node ids: ['node0', 'node1'])" in outs[0], outs[0]
    assert "mesh (2, 2) ('agkv', 'ulysses')" in outs[0] and "over ranks: 0\n" in outs[0], outs[0]


def test_attention_2d_mesh_argument():
    """The example's --mesh: 'OxI' with two ints >= 1, else argparse's error naming the form (was: int()'s ValueError
    on every rank, e.g. for '2x')."""
    import argparse

    from cp_ops.examples.attention_2d import mesh_arg

    assert mesh_arg("2x4") == (2, 4) and mesh_arg("1X8") == (1, 8)
    for bad in ("2x", "x4", "2x4x1", "0x4", "two", "-1x4"):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"takes OxI.*got '{bad}'"):
            mesh_arg(bad)
