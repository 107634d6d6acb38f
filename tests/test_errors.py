"""Every bad-input rule raises an error naming the rule and the values seen; transport selection."""

import pytest
import torch

import cp_ops
from dist_util import run_ranks


def _bad_inputs(rank, w):
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(1, 8, 4, 16, generator=g)
    with pytest.raises(ValueError, match=r"4-D \[batch, seq, heads, head_dim\].*3-D shape \(8, 4, 16\)"):
        cp_ops.attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match=r"same BSHD shape.*\(1, 8, 4, 16\).*\(1, 8, 2, 16\)"):
        cp_ops.attention(q, q, q[:, :, :2])
    with pytest.raises(ValueError, match="same dtype.*float32.*bfloat16"):
        cp_ops.attention(q, q, q.bfloat16())
    with pytest.raises(ValueError, match=r"divisible by the CP world size; got heads=3, world_size=2"):
        cp_ops.attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], mode="ulysses")
    with pytest.raises(ValueError, match="mode must be one of"):
        cp_ops.attention(q, q, q, mode="ring")
    with pytest.raises(ValueError, match="transport must be one of"):
        cp_ops.attention(q, q, q, transport="nvlink")
    m = torch.empty(1, 8, 4, 16, device="meta")
    with pytest.raises(ValueError, match="backend 'gloo' cannot move meta tensors"):
        cp_ops.attention(m, m, m)
    with pytest.raises(RuntimeError, match="transport='fast' cannot run: the tensors are on 'cpu'"):
        cp_ops.attention(q, q, q, transport="fast")
    # ranks disagree on S_local: every rank raises, nobody hangs
    s_local = 8 if rank == 0 else 16
    x = torch.randn(1, s_local, 4, 16, generator=g)
    with pytest.raises(ValueError, match=r"same cp_ops calls.*differ in shape: rank 0: cp_ops.attention \(call #\d+\) \[B, S_local, H, D\]=\[1, 8, 4, 16\].*rank 1: cp_ops.attention \(call #\d+\) \[B, S_local, H, D\]=\[1, 16, 4, 16\].*; only S_local differs: for uneven shards pass seq_lens=\(8, 16\)"):
        cp_ops.attention(x, x, x, mode="agkv")
    # ranks disagree on H (Ulysses): no seq_lens hint
    hx = torch.randn(1, 8, 4 if rank == 0 else 6, 16, generator=g)
    with pytest.raises(ValueError, match="differ in shape") as e:
        cp_ops.attention(hx, hx, hx, mode="ulysses")
    assert "seq_lens" not in str(e.value)
    # ranks disagree on dtype
    dx = q if rank == 0 else q.bfloat16()
    with pytest.raises(ValueError, match="differ in dtype.*dtype=float32.*dtype=bfloat16") as e:
        cp_ops.agkv_gather(dx, dx)
    assert "CP variants" not in str(e.value)  # the same op on every rank: no mode/chunks hint
    # one rank fails its own checks (H=3 with Ulysses), the other's inputs are fine: both raise, nobody waits
    hh = 3 if rank == 1 else 4
    x = torch.randn(1, 8, hh, 16, generator=g)
    if rank == 1:
        with pytest.raises(ValueError, match="got heads=3, world_size=2"):
            cp_ops.attention(x, x, x, mode="ulysses")
    else:
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] of CP group '0' rejected their inputs \(rank 1: "
                                             r"cp_ops.attention: ValueError: .*got heads=3, world_size=2"):
            cp_ops.attention(x, x, x, mode="ulysses")
    # ranks call different modes: the message names what each called, and mode/chunks as the likely cause
    with pytest.raises(ValueError, match="differ in .*variant.*rank 0: cp_ops.attention .*mode=agkv.* rank 1: "
                                         "cp_ops.attention .*mode=ulysses.*must get the same mode and chunks on every rank"):
        cp_ops.attention(q, q, q, mode="agkv" if rank == 0 else "ulysses")
    # ... or different chunks (rank 1 pipelines AGKV)
    with pytest.raises(ValueError, match="differ in variant.*rank 0: cp_ops.attention .*chunks=1.* rank 1: "
                                         "cp_ops.attention .*chunks=2.*the same mode and chunks"):
        cp_ops.attention(q, q, q, mode="agkv", chunks=1 + rank)
    # non-float tensors and no tensors at all
    with pytest.raises(ValueError, match="k must be float32, float16 or bfloat16.*got torch.int64"):
        cp_ops.agkv_gather(q.long(), q.long())
    with pytest.raises(ValueError, match="at least one tensor is needed"):
        cp_ops.ulysses_all_to_all()
    # direct op call with mismatched tensors: the real kernel checks what the fake kernel checks
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"xs\[0\] and xs\[1\] must have the same BSHD shape.*\(1, 8, 4, 16\) and xs\[1\] \(1, 8, 2, 16\)"):
        torch.ops.cp_ops.ulysses_start([q, q[:, :, :2].contiguous()], w, dist.group.WORLD.group_name, "torch")
    # an empty batch moves nothing and returns empty outputs
    e = torch.randn(0, 8, 4, 16)
    for mode in ("agkv", "ulysses"):
        assert cp_ops.attention(e, e, e, mode=mode).shape == (0, 8, 4, 16), mode
    # the group is still healthy afterwards
    out = cp_ops.attention(q, q, q, mode="agkv")
    assert out.shape == q.shape and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="divisible by the CP world size to split tokens evenly; got sequence length=7, world_size=2"):
        cp_ops.ulysses_all_to_all_inverse(torch.randn(1, 7, 2, 4, generator=g))


def test_bad_inputs_raise_named_errors():
    run_ranks(_bad_inputs, 2)


def test_select_transport():
    assert cp_ops.select_transport("torch", "cpu") == "torch"
    assert cp_ops.select_transport("auto", "cpu") == "torch"
    with pytest.raises(RuntimeError, match="transport='fast' cannot run: the tensors are on 'cpu'.*transport='torch'"):
        cp_ops.select_transport("fast", "cpu")
    with pytest.raises(ValueError, match=r"transport must be one of \('auto', 'torch', 'fast'\); got 'nccl'"):
        cp_ops.select_transport("nccl", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine message")
def test_fast_reason_without_cuda():
    from cp_ops.transport.fast import unavailable_reason

    assert "torch.cuda.is_available() is False" in unavailable_reason("cuda")


def test_uninitialized_distributed_is_a_clear_error():
    import torch.distributed as dist

    assert not dist.is_initialized()
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        cp_ops.attention(q, q, q)


def _backward_refused(rank, w):
    g = torch.Generator().manual_seed(rank)
    for mode in ("agkv", "ulysses"):
        q = torch.randn(1, 8, 4, 16, generator=g, requires_grad=True)
        out = cp_ops.attention(q, q * 1.0, q * 2.0, mode=mode)
        assert out.requires_grad
        with pytest.raises(RuntimeError, match="cp_ops.attention has no backward: cp_ops targets DiT inference"):
            out.sum().backward()


def test_backward_is_a_clear_error():
    run_ranks(_backward_refused, 2)
