"""Shape/tracing at W=8 without 8 processes: a fake process group and make_fx with fake tensors."""

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import cp_ops


@pytest.fixture
def fake_world_8():
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _op_nodes(gm):
    return {n.target.name(): n for n in gm.graph.nodes if n.op == "call_function" and "cp_ops" in str(n.target)}


@pytest.mark.parametrize("mode", ["agkv", "ulysses"])
def test_trace_w8_shapes(fake_world_8, mode):
    b, s_local, h, d = 2, 64, 16, 32
    q, k, v = (torch.randn(b, s_local, h, d) for _ in range(3))
    fn = lambda q, k, v: cp_ops.attention(q, k, v, mode=mode)  # noqa: E731
    gm = make_fx(fn, tracing_mode="fake")(q, k, v)
    ops = _op_nodes(gm)
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert tuple(out.meta["val"].shape) == (b, s_local, h, d)
    waits = [n for n in gm.graph.nodes if "wait_tensor" in str(n.target)]
    if mode == "agkv":
        assert list(ops) == ["cp_ops::agkv_gather_start"]
        k_full = ops["cp_ops::agkv_gather_start"].meta["val"][0]
        assert tuple(k_full.shape) == (b, 8 * s_local, h, d)
        assert len(waits) == 2
    else:
        # traced: the send buffer packed by torch code (cp_ops.comm.OpComm.ulysses), then one launch
        assert set(ops) == {"cp_ops::ulysses_packed_start", "cp_ops::ulysses_inverse_start"}
        assert tuple(ops["cp_ops::ulysses_packed_start"].meta["val"].shape) == (8, b, s_local, 3, h // 8, d)
        assert tuple(ops["cp_ops::ulysses_inverse_start"].meta["val"].shape) == (8, b, s_local, h // 8, d)
        assert len(waits) == 2


def test_fake_kernel_rejects_bad_heads(fake_world_8):
    x = torch.randn(1, 8, 12, 4)
    with pytest.raises(ValueError, match="heads=12, world_size=8"):
        make_fx(lambda x: cp_ops.attention(x, x, x, mode="ulysses"), tracing_mode="fake")(x)
    # the fake kernel checks the public API's rule (cp_ops.validate), with the same message
    with pytest.raises(ValueError, match="divisible by the CP world size; got heads=12, world_size=8"):
        make_fx(lambda x: torch.ops.cp_ops.ulysses_start([x], 8, dist.group.WORLD.group_name, "torch"),
                tracing_mode="fake")(x)
