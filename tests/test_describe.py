"""cp_ops.describe (issue 22 item 5): what cp_ops.attention picked, or would pick, for a call — mode, chunks,
transport, source ('explicit', 'heuristic', 'pending', 'measured', 'cached') and why — on 2 gloo ranks; local (one
rank may call it alone: no collective), and the call's own local errors."""

import os

import pytest
import torch

import cp_ops
from dist_util import run_ranks

B, S_LOCAL, H, D = 1, 5, 6, 8


def _shard(rank, seed, h=H):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, S_LOCAL, h, D, generator=g) + rank for _ in range(3))


def test_describe_is_public():
    assert "describe" in cp_ops.__all__ and callable(cp_ops.describe)
    doc = cp_ops.describe.__doc__
    for word in ("Args:", "Returns:", "Raises:", "'measured'", "'cached'", "'heuristic'", "'explicit'"):
        assert word in doc, word


def _body(rank, w, tmp):
    import torch.distributed as dist

    from cp_ops import config
    from cp_ops.plan import measured as choices
    from cp_ops.plan import measured as tune

    q, k, v = _shard(rank, 1)
    # measuring off (the default): the heuristic, before and after the call, the same on every rank
    c = cp_ops.describe(q, k, v)
    assert (c.mode, c.chunks, c.source, c.transport, c.times_ms) == ("agkv", 1, "heuristic", "torch", {}), c
    assert "measuring off" in c.why, c.why
    # one rank alone asks (no collective: the other rank goes straight to the call, and nothing pairs off wrong)
    if rank == 0:
        for _ in range(3):
            cp_ops.describe(q, mode="ulysses")
    out = cp_ops.attention(q, k, v)
    assert cp_ops.describe(q, k, v) == c
    assert torch.equal(out, cp_ops.attention(q, k, v, mode=c.mode, chunks=c.chunks))
    assert cp_ops.describe(q.transpose(1, 2), layout="bhsd") == c  # BHSD: the same call
    # explicit mode and chunks; uneven shards
    e = cp_ops.describe(q, mode="ulysses", chunks=2, transport="torch")
    assert e[:5] == ("ulysses", 2, "explicit", {}, "torch"), e
    u = cp_ops.describe(q, seq_lens=(S_LOCAL, S_LOCAL))
    assert (u.chunks, u.source) == (1, "heuristic") and "uneven" in u.why, u
    # the call's own local errors, raised on this rank alone
    with pytest.raises(ValueError, match="chunks must be None"):
        cp_ops.describe(q, chunks=0)
    with pytest.raises(ValueError, match="divisible"):
        cp_ops.describe(_shard(rank, 2, h=5)[0], mode="ulysses")
    with pytest.raises(ValueError, match="layout must be"):
        cp_ops.describe(q, layout="sbhd")
    with pytest.raises(ValueError, match="4-D|BSHD|dims"):
        cp_ops.describe(q[0])

    # measuring on: pending before the first call, measured by it, cached (from the file) in a fresh memory
    tune.WARMUP, tune.ROUNDS, tune.MIN_ROUNDS, tune.SAMPLE_MS = 1, 1, 1, 1.0
    config.configure(tune_modes=True, tune_cache=os.path.join(tmp, f"rank{rank}.json"))
    q2, k2, v2 = _shard(rank, 3, h=4)
    p = cp_ops.describe(q2, mode="agkv")
    assert (p.mode, p.chunks, p.source) == ("agkv", 1, "pending") and "agkv/2" in p.why, p
    cp_ops.attention(q2, k2, v2, mode="agkv")
    m = cp_ops.describe(q2, mode="agkv")
    assert m.source == "measured" and set(m.times_ms) == {"agkv/1", "agkv/2", "agkv/4"} and m.transport == "torch", m
    assert m[:2] == choices.lookup("agkv", None, q2, dist.group.WORLD, "torch")[:2]
    cp_ops.plan.forget()
    cp_ops.attention(q2, k2, v2, mode="agkv")
    cached = cp_ops.describe(q2, mode="agkv")
    assert cached.source == "cached" and cached[:2] == m[:2] and cached.times_ms == m.times_ms, cached
    assert "cache file" in cached.why, cached.why


def test_describe_on_two_ranks(tmp_path):
    run_ranks(_body, 2, str(tmp_path))


@pytest.mark.parametrize("world,heads,rule", [(2, 8, "auto: W=2 -> agkv"),
                                              (4, 8, "auto: W=4 > 2 and W divides H=8 -> ulysses"),
                                              (4, 6, "auto: W=4 does not divide H=6 -> agkv")])
def test_describe_names_the_heuristics_rule(world, heads, rule):
    """The heuristic's choice says which branch of its rule fired (mode and chunks), not only 'the heuristic'."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        c = cp_ops.describe(torch.randn(1, 16, heads, 8))
        assert c.source == "heuristic" and rule in c.why, c.why
        assert "chunks=None -> 1" in c.why, c.why
        given = cp_ops.describe(torch.randn(1, 16, heads, 8), mode="agkv")
        assert "mode 'agkv' given" in given.why, given.why
        # uneven shards (chunks 1 by rule): the mode's rule too
        u = cp_ops.describe(torch.randn(1, 16, heads, 8), seq_lens=(16,) * (world - 1) + (15,))
        assert "uneven shards" in u.why and rule in u.why and "chunks=None -> 1 (2 stages" not in u.why, u.why
    finally:
        dist.destroy_process_group()


def test_describe_says_why_kv_apart_runs_ulysses():
    """mode='auto' with comm_dtype sending K and V in different formats runs Ulysses (AGKV gathers both in one
    format): describe names that rule, not "mode 'ulysses' given" / "mode and chunks given by the caller" (was)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    e4 = torch.float8_e4m3fn
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        q = torch.randn(1, 16, 8, 8)
        for chunks in (None, 1):
            c = cp_ops.describe(q, comm_dtype={"q": e4, "v": e4, "o": e4}, chunks=chunks)
            assert (c.mode, c.chunks, c.source) == ("ulysses", 1, "heuristic"), c
            assert "comm_dtype sends K and V in different formats" in c.why and "W=4 divides H=8" in c.why, c.why
            assert "given by the caller" not in c.why and "mode 'ulysses' given" not in c.why, c.why
        assert "mode 'ulysses' given" in cp_ops.describe(q, mode="ulysses", comm_dtype={"v": e4}).why
        assert "-> ulysses (moves less" in cp_ops.describe(q, comm_dtype=e4).why  # K and V alike: the plain rule
    finally:
        dist.destroy_process_group()
