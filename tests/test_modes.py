"""The modes registry: one file + one registration make a mode reachable from every entry point."""

import pytest
import torch

import cp_ops
from cp_ops import modes
from dist_util import run_ranks


def _mine(q, k, v, comm, *, scale=None, chunks=1, shards=None, key_mask=None):
    """A test mode body: AGKV's body through the registry, counted so the test sees it ran."""
    _mine.calls += 1
    return modes.body("agkv", 1)(q, k, v, comm, scale=scale, chunks=chunks, shards=shards, key_mask=key_mask)


_mine.calls = 0


def test_registry_names_and_choose():
    assert modes.names() == ("auto", "agkv", "ulysses")
    assert modes.names(include_auto=False) == ("agkv", "ulysses")
    assert cp_ops.choose_mode("auto", 8, 4) == "ulysses" and cp_ops.choose_mode("auto", 6, 4) == "agkv"
    assert cp_ops.choose_mode("auto", 8, 2) == "agkv"  # W = 2: the same bytes either way, AGKV measured ahead
    assert cp_ops.choose_mode("agkv", 6, 4) == "agkv"
    with pytest.raises(ValueError, match=r"mode='ulysses' needs the head count divisible .* got heads=6, world_size=4"):
        cp_ops.choose_mode("ulysses", 6, 4)
    with pytest.raises(ValueError, match=r"mode must be one of \('auto', 'agkv', 'ulysses'\); got 'nope'"):
        cp_ops.choose_mode("nope", 8, 2)
    with pytest.raises(ValueError, match="other than 'auto'"):
        modes.register("auto", _mine)


def _new_mode_everywhere(rank, w):
    from cp_ops.cli.main import build_parser

    modes.register("mine", _mine, needs_heads_divisible=True, summary="test")
    assert "mine" in modes.names()
    args = build_parser().parse_args(["run", "wan", "--mode", "mine"])  # CLI choices derive from the registry
    assert args.mode == "mine"
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 64, 4, 16, generator=g) for _ in range(3))
    s = 64 // w
    sh = [t[:, rank * s:(rank + 1) * s] for t in (q, k, v)]
    out = cp_ops.attention(*sh, mode="mine")
    assert _mine.calls == 1
    assert torch.equal(out, cp_ops.local_attention(q, k, v)[:, rank * s:(rank + 1) * s])
    with pytest.raises(ValueError, match=r"mode='mine' needs the head count divisible"):
        cp_ops.attention(*(t[:, :, :3] for t in sh), mode="mine")


def test_new_mode_reaches_attention_and_cli():
    run_ranks(_new_mode_everywhere, 2)
