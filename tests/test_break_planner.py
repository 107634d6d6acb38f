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
