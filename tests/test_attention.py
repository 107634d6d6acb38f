"""AGKV and Ulysses equal single-process attention on real gloo groups (2 and 4 ranks)."""

import pytest
import torch

import cp_ops
from dist_util import run_ranks

SHAPES = [(1, 256, 4, 32), (2, 128, 8, 16), (1, 512, 8, 64), (2, 96, 4, 8)]


def _shard(t, rank, w):
    s = t.shape[1] // w
    return t[:, rank * s : (rank + 1) * s]


def _equal_to_single_device(rank, w):
    for b, s, h, d in SHAPES:
        for seed in (0, 1):
            g = torch.Generator().manual_seed(seed * 1000 + s)
            q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
            ref = _shard(cp_ops.local_attention(q, k, v), rank, w)
            modes = ["agkv", "ulysses"] if h % w == 0 else ["agkv"]
            for mode in modes + ["auto"]:
                out = cp_ops.attention(_shard(q, rank, w), _shard(k, rank, w), _shard(v, rank, w), mode=mode)
                assert out.shape == ref.shape, (mode, out.shape, ref.shape)
                # Same kernel, same data for these rows/heads: bitwise equal on CPU's SDPA.
                assert torch.equal(out, ref), (mode, (b, s, h, d), (out - ref).abs().max().item())
    # bf16 and a custom scale
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 128, 4, 16, generator=g).bfloat16() for _ in range(3))
    ref = _shard(cp_ops.local_attention(q, k, v, scale=0.3), rank, w)
    for mode in ("agkv", "ulysses"):
        out = cp_ops.attention(_shard(q, rank, w), _shard(k, rank, w), _shard(v, rank, w), mode=mode, scale=0.3)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, ref), mode


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_attention_equals_single_device(world_size):
    run_ranks(_equal_to_single_device, world_size)
