"""The launch ops on real gloo groups: async + wait_tensor, layouts, opcheck, blocking mode. Compiled by Inductor:
tests/test_uneven.py (torch.compile of both modes in one graph, uneven shards and a key mask) and
tests/test_pass_correctness.py (a fused-QKV block, overlap pass off and on, bitwise, = eager = single device)."""

import pytest
import torch

import cp_ops
from cp_ops import config, layout
from dist_util import run_ranks


def _rank_data(rank, b, s, h, d, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g)


def _async_and_layouts(rank, w):
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    for b, s, h, d in [(1, 16, 4, 8), (2, 8, 8, 4)]:
        k, v = _rank_data(rank, b, s, h, d, seed=s)
        all_k = torch.cat([_rank_data(r, b, s, h, d, seed=s)[0] for r in range(w)], dim=1)
        all_v = torch.cat([_rank_data(r, b, s, h, d, seed=s)[1] for r in range(w)], dim=1)
        # async launch, then wait through c10d's wait_tensor
        k_full, v_full = torch.ops.cp_ops.agkv_gather_start(k, v, w, name, "torch")
        k_full = torch.ops._c10d_functional.wait_tensor(k_full)
        v_full = torch.ops._c10d_functional.wait_tensor(v_full)
        assert k_full.is_contiguous() and k_full.shape == (b, w * s, h, d)
        assert torch.equal(k_full, all_k) and torch.equal(v_full, all_v)
        # eager wrappers
        k2, v2 = cp_ops.agkv_gather(k, v)
        assert torch.equal(k2, all_k) and torch.equal(v2, all_v)
        # Ulysses: rank r gets the full sequence of its head group
        hl = h // w
        outs = cp_ops.ulysses_all_to_all(k, v)
        assert torch.equal(outs[0], all_k[:, :, rank * hl : (rank + 1) * hl])
        assert torch.equal(outs[1], all_v[:, :, rank * hl : (rank + 1) * hl])
        if b == 1:  # no copy after the all-to-all: a strided view of the receive buffer
            assert outs[0].data_ptr() + outs[0].element_size() * hl * d == outs[1].data_ptr()
        back = cp_ops.ulysses_all_to_all_inverse(outs[1])
        assert torch.equal(back, v)
        buf = torch.ops.cp_ops.ulysses_start([k], w, name, "torch")
        buf = torch.ops._c10d_functional.wait_tensor(buf)
        assert buf.shape == (w, b, s, 1, hl, d)
        assert torch.equal(layout.ulysses_unpack(buf, 0), outs[0])
        # a send buffer packed by traced code (what compiled code launches): the same bytes arrive, bitwise
        xs = [v, k, v * 2]
        send = layout.ulysses_pack_traced(xs, w)
        assert send.is_contiguous() and torch.equal(send, layout.ulysses_pack(xs, w))
        if hl > 1:  # pipelined Ulysses' sub-groups: heads [lo, hi) of every head group
            assert torch.equal(layout.ulysses_pack_traced(xs, w, 1, hl), layout.ulysses_pack(xs, w, 1, hl))
        packed = torch.ops._c10d_functional.wait_tensor(torch.ops.cp_ops.ulysses_packed_start(send, w, name, "torch"))
        whole = torch.ops._c10d_functional.wait_tensor(torch.ops.cp_ops.ulysses_start(xs, w, name, "torch"))
        assert packed.shape == (w, b, s, 3, hl, d) and torch.equal(packed, whole)
        assert torch.equal(layout.ulysses_unpack(packed, 1), outs[0])
        from cp_ops.transport.torch import transport as torch_transport

        torch_transport.ulysses_packed_start = None  # a transport without it: the slabs move as the inverse moves
        try:
            moved = torch.ops._c10d_functional.wait_tensor(torch.ops.cp_ops.ulysses_packed_start(send, w, name, "torch"))
        finally:
            del torch_transport.ulysses_packed_start
        assert torch.equal(moved, whole)
    # blocking mode (CUDA_LAUNCH_BLOCKING-style) gives the same results
    config.settings.blocking = True
    try:
        k, v = _rank_data(rank, 1, 16, 4, 8, seed=3)
        kb, vb = cp_ops.agkv_gather(k, v)
    finally:
        config.settings.blocking = False
    ka, va = cp_ops.agkv_gather(k, v)
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("world_size", [2, 4])
def test_async_launch_wait_tensor_and_layouts(world_size):
    run_ranks(_async_and_layouts, world_size)


def _opcheck(rank, w):
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    config.settings.blocking = True  # opcheck compares outputs without waiting: launch blocking
    k, v = _rank_data(rank, 2, 8, 4, 16, seed=11)
    torch.library.opcheck(torch.ops.cp_ops.agkv_gather_start, (k, v, w, name, "torch"))
    torch.library.opcheck(torch.ops.cp_ops.ulysses_start, ([k, v, k * 2], w, name, "torch"))
    torch.library.opcheck(torch.ops.cp_ops.ulysses_inverse_start, (k, w, name, "torch"))
    torch.library.opcheck(torch.ops.cp_ops.ulysses_packed_start, (layout.ulysses_pack([k, v], w), w, name, "torch"))
    # the ordering input (pipelined Ulysses under compile): never read
    torch.library.opcheck(torch.ops.cp_ops.ulysses_inverse_start, (k, w, name, "torch", "", 0, None, v))
    torch.library.opcheck(torch.ops.cp_ops.ulysses_packed_start,
                          (layout.ulysses_pack([k, v], w), w, name, "torch", "", 0, None, 0, v))
    back = torch.randn(w, 2, 5, 3, 16)  # [W, B, S', Hl, D] -> out [B, S <= S', W, Hl, D], here a view
    out = torch.zeros(2, 4, w, 6, 16)[:, :, :, 1:4]
    torch.library.opcheck(torch.ops.cp_ops.ulysses_inverse_copy_out, (back, out))
    torch.ops.cp_ops.ulysses_inverse_copy_out(back, out)
    assert torch.equal(out, back[:, :, :4].permute(1, 2, 0, 3, 4))


def test_opcheck_every_op():
    run_ranks(_opcheck, 2)
