"""Attempts to break the planner (cp_ops/plan/), the waits and the rank contract on real gloo ranks."""

import time

import numpy as np
import pytest
import torch

import cp_ops
from cp_ops import layout
from cp_ops.kernels import local_attention
from dist_util import run_ranks


def _data(b, total, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, total, h, d, generator=g) for _ in range(3))


# ---- the plan cache and scales that hash alike --------------------------------------------------------------------
def _scale_types(rank, w):
    """``True`` and ``numpy.float32(1)`` hash like ``1``: after a call with scale=1 the plan cache served them with
    that plan, silently, where a first call raises TypeError (a scale must be a Python float or int)."""
    b, h, d = 1, 2 * w, 8
    q, k, v = _data(b, 3 * w, h, d, seed=1)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    ref = sh(local_attention(q, k, v, 1.0))
    torch.testing.assert_close(cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", scale=1), ref)
    for bad in (True, np.float32(1.0)):
        with pytest.raises(TypeError, match="scale must be None"):
            cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", scale=bad)


def test_plan_cache_refuses_scale_of_other_type_after_equal_one():
    run_ranks(_scale_types, 2)


# ---- q/k/v whose head dim is strided (views of a fused qkv tensor) ------------------------------------------------
def test_lse_kernel_takes_a_strided_head_dim():
    """The LSE kernel (pipelined AGKV's) is an aten op called past SDPA's dispatcher: on CPU it read q/k/v whose last
    dim has stride 3 (``fused[..., i]`` of a ``[B, S, H, D, 3]`` tensor) as dense and returned wrong numbers."""
    from cp_ops.kernels import attention_with_lse

    q, k, v = _data(2, 6, 2, 8, seed=3)
    fused = torch.stack([q, k, v], dim=-1)
    fq, fk, fv = fused[..., 0], fused[..., 1], fused[..., 2]
    assert fq.stride(-1) == 3
    o, lse = attention_with_lse(q, k, v, 0.4)
    fo, flse = attention_with_lse(fq, fk, fv, 0.4)
    assert torch.equal(fo, o) and torch.equal(flse, lse)  # the same kernel on the same values: bitwise
    torch.testing.assert_close(o, local_attention(q, k, v, 0.4), rtol=1e-5, atol=1e-5)


def _fused_qkv(rank, w):
    """Pipelined AGKV on q/k/v sliced from one fused tensor (strided head dim): wrong numbers before the fix."""
    b, h, d = 1, 2, 8
    q, k, v = _data(b, 3 * w, h, d, seed=15)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    ref = sh(local_attention(q, k, v))
    fused = torch.stack([sh(q), sh(k), sh(v)], dim=-1)
    for mode in ("agkv", "ulysses"):
        out = cp_ops.attention(fused[..., 0], fused[..., 1], fused[..., 2], mode=mode, chunks=2)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_pipelined_agkv_on_views_of_a_fused_qkv():
    run_ranks(_fused_qkv, 2)


# ---- a rank that skips a call (not the first) and stays alive -----------------------------------------------------
def _skipped_call(rank, w):
    """Rank 1 skips call #2. Rank 0's exchange of call #2 stayed posted after its timeout, so rank 0's next call waited
    a whole CP_OPS_TIMEOUT_S again, blaming rank 1 (which had arrived, paired with that stale exchange and was told
    rank 0 failed). Now the timeout says the group is unusable, and a later call on it raises at once."""
    from cp_ops import config

    config.configure(timeout_s=2, wait_warn_s=60)
    q, k, v = _data(1, 4 * w, 2 * w, 8, seed=4)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    ref = sh(local_attention(q, k, v))
    torch.testing.assert_close(cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv"), ref)
    if rank == 0:
        with pytest.raises(RuntimeError, match=r"did not arrive within CP_OPS_TIMEOUT_S=2 s.*\n.*cannot be used"):
            cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv")
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"call #2 .*timed out in its rank check; the group cannot be used"):
            cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv")
        assert time.monotonic() - t0 < 1.0, time.monotonic() - t0
    else:
        time.sleep(3)  # past rank 0's timeout; alive while rank 0 checks


def test_a_timed_out_call_leaves_the_group_refusing_at_once():
    run_ranks(_skipped_call, 2, timeout=60)
