"""Attempts to break the one-body data path (dispatch → mode body → OpComm/DirectComm) on real gloo ranks: what
broke, kept as tests. Compared with single-device attention on fresh random inputs."""

import pytest
import torch

import cp_ops
import cp_ops.modes.agkv_pipelined as M_pipelined
import cp_ops.modes.ulysses as M_ulysses
from cp_ops import layout, plan
from cp_ops.kernels import local_attention
from dist_util import run_ranks


def _data(b, total, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, total, h, d, generator=g) for _ in range(3))


# ---- an int tag / chunks that changes between compiles of the same code ------------------------------------------
def _compiled_changing_ints(rank, w):
    """Dynamo holds an int argument that changed between compiles of one function as a lazy constant (torch 2.13),
    which the variant tag (a constant function) could not take: torch.compile(fullgraph=True) failed with
    'assume_constant_result argument conversion failed' from the second tag/chunks value on."""
    b, h, d = 1, 2 * w, 8
    q, k, v = _data(b, 4 * w, h, d, seed=w)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    ref = sh(local_attention(q, k, v))

    def block(q, k, v, tag, chunks):
        return cp_ops.attention(q, k, v, mode="ulysses", chunks=chunks, tag=tag) * 2

    comp = torch.compile(block, fullgraph=True, backend="aot_eager")  # Dynamo's constants are the point (CI time)
    for tag, chunks in ((0, 1), (1, 1), (2, 2), ((3, "x"), 2)):  # one graph per value (guarded constants)
        with torch.no_grad():
            out = comp(sh(q), sh(k), sh(v), tag, chunks)
        torch.testing.assert_close(out, ref * 2, rtol=1e-5, atol=1e-5)
        # and the same call eager on this rank, compiled on the peers: the same rank contract
        eager = block(sh(q), sh(k), sh(v), tag, chunks) if rank == 0 else comp(sh(q), sh(k), sh(v), tag, chunks)
        torch.testing.assert_close(eager, ref * 2, rtol=1e-5, atol=1e-5)


def test_int_tag_and_chunks_changing_between_compiles():
    run_ranks(_compiled_changing_ints, 2)


# ---- the eager plan cache and tags that hash alike ----------------------------------------------------------------
def _tags_hash_alike(rank, w):
    """``True == 1 == 1.0`` with one hash: the plan cache keyed by the tag served tag=1 with the plan (and variant tag)
    of tag=True, so a rank whose cache did not hold that plan disagreed with its peers, and tag=1.0 (not a valid tag)
    was accepted after tag=1."""
    b, h, d = 1, 2 * w, 8
    q, k, v = _data(b, 3 * w, h, d, seed=10 + w)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    ref = sh(local_attention(q, k, v))
    torch.testing.assert_close(cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", tag=True), ref)
    if rank == 1:
        plan.forget()  # e.g. the cache was cleared (a shape sweep, a tuning reset) on one rank only
    torch.testing.assert_close(cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", tag=1), ref)
    with pytest.raises(TypeError, match=r"tag must be an int, a str, or a tuple of them .*got float 1.0"):
        cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", tag=1.0)
    # a list tag (unhashable) takes the eager plan too, and ranks with different tags are named on every rank
    torch.testing.assert_close(cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", tag=[1, "a"]), ref)
    with pytest.raises(ValueError, match=r"differ in variant: rank 0: .*tag=0.*; rank 1: .*tag=1"):
        cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", tag=rank)
    torch.testing.assert_close(cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", tag=1), ref)


def test_plan_cache_tells_tags_apart():
    run_ranks(_tags_hash_alike, 2)


# ---- an exception between a launch and its wait, on every rank: the next call works ---------------------------------
class _Injected(RuntimeError):
    pass


def _raise_once(fn, left):
    def wrapped(*a, **kw):
        if left:
            left.pop()
            raise _Injected("injected between launch and wait")
        return fn(*a, **kw)
    return wrapped


def _fault_then_next_call(rank, w):
    b, h, d = 1, 2 * w, 8
    seq = layout.shard_sizes(4 * w + 1, w)
    cases = [("ulysses", 1, None), ("ulysses", 3, None), ("ulysses", 2, seq), ("agkv", 2, None), ("agkv", 3, seq)]
    for i, (mode, chunks, seq_lens) in enumerate(cases):
        total = sum(seq_lens) if seq_lens else 4 * w
        q, k, v = _data(b, total, h, d, seed=20 + i)
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq_lens)  # noqa: E731
        ref = sh(local_attention(q, k, v))
        for tag in (i, [i]):  # an int tag: the eager plan (DirectComm); a list: also eager now; traced below
            saved = (M_ulysses.local_attention, M_pipelined.attention_with_lse)
            left = [1]
            M_ulysses.local_attention = _raise_once(saved[0], left)
            M_pipelined.attention_with_lse = _raise_once(saved[1], left)
            try:
                with pytest.raises(_Injected):
                    cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, chunks=chunks, seq_lens=seq_lens, tag=tag)
            finally:
                M_ulysses.local_attention, M_pipelined.attention_with_lse = saved
            out = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, chunks=chunks, seq_lens=seq_lens, tag=tag)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [2, 3])
def test_exception_between_launch_and_wait_on_every_rank(world_size):
    run_ranks(_fault_then_next_call, world_size)
