"""The lean eager path of cp_ops.attention (cp_ops.plan's cache): a repeat call reuses its cached plan (no input checks,
no dispatcher), still makes exactly one rank-contract exchange per call, and still catches ranks that disagree —
including on chunks, which pipelined Ulysses adds to its signature. CPU gloo, W = 2."""

import pytest
import torch
import torch.distributed as dist

import cp_ops
from dist_util import run_ranks

H, D = 4, 8


def _plans(rank, w):
    from cp_ops import plan as A
    from cp_ops.plan import flat as F
    from cp_ops import contract as validate

    pg = dist.group.WORLD
    g = torch.Generator().manual_seed(11)
    full = [torch.randn(1, w * 6, H, D, generator=g) for _ in range(3)]
    q, k, v = (x[:, rank * 6:(rank + 1) * 6].contiguous() for x in full)
    ref = cp_ops.local_attention(q, full[1], full[2])
    built = []
    orig_build, orig_checked = A._build, F.decide
    A._build = lambda call: built.append((call.mode, call.transport, call.chunks)) or orig_build(call)
    F.decide = lambda *a: (_ for _ in ()).throw(AssertionError("input checks ran on a cached call"))
    try:
        for mode in ("agkv", "ulysses"):
            for chunks in (1, 2):
                F.decide = orig_checked
                first = cp_ops.attention(q, k, v, mode=mode, chunks=chunks)  # builds the plan (checks run once)
                F.decide = lambda *a: (_ for _ in ()).throw(AssertionError("input checks ran on a cached call"))
                n = validate.call_count(pg)
                for _ in range(3):
                    out = cp_ops.attention(q, k, v, mode=mode, chunks=chunks)
                    assert torch.equal(out, first)
                # one exchange per call, whatever the mode and chunks (made by the call's first launch, as traced)
                assert validate.call_count(pg) == n + 3, (mode, chunks, validate.call_count(pg) - n)
                if chunks == 1:
                    assert torch.equal(out, ref), mode  # bitwise: the same SDPA kernel on the same data
                else:
                    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert built == [("agkv", "auto", 1), ("agkv", "auto", 2), ("ulysses", "auto", 1), ("ulysses", "auto", 2)]
    finally:
        A._build, F.decide = orig_build, orig_checked
    # a rank that passes another chunks count to pipelined Ulysses (same call name, same shape): named, on every rank
    c = 1 if rank == 0 else 2
    with pytest.raises(ValueError, match=r"differ in (shape, )?variant: rank 0: cp_ops.attention \(call #\d+\) .*mode=ulysses "
                                         r"chunks=1.*; rank 1: cp_ops.attention .*mode=ulysses chunks=2"):
        cp_ops.attention(q, k, v, mode="ulysses", chunks=c)
    # the group is healthy afterwards, and a seen shape on one rank vs another seen shape is still caught
    cp_ops.attention(q[:, :3].contiguous(), k[:, :3].contiguous(), v[:, :3].contiguous(), mode="agkv")
    s = 3 if rank == 1 else 6
    with pytest.raises(ValueError, match=r"differ in shape"):
        cp_ops.attention(q[:, :s].contiguous(), k[:, :s].contiguous(), v[:, :s].contiguous(), mode="agkv")
    assert torch.equal(cp_ops.attention(q, k, v, mode="agkv", chunks=1), ref)
    # with inputs that require grad: forward runs through the plan, backward raises
    qg = q.clone().requires_grad_()
    out = cp_ops.attention(qg, k, v, mode="agkv", chunks=1)
    assert out.requires_grad and torch.equal(out.detach(), ref)
    with pytest.raises(RuntimeError, match="has no backward"):
        out.sum().backward()


def test_repeat_calls_use_the_plan_and_still_exchange_every_call():
    run_ranks(_plans, 2)


def test_call_replace_copies_and_names_an_unknown_field():
    """``Call.replace`` gives a changed copy (the original unchanged) and raises TypeError naming a field a Call has
    not, instead of setting it."""
    from cp_ops.plan import make

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(3))
    call = make(q, k, v, mode="agkv", chunks=2, tag=3)
    other = call.replace(mode="ulysses", chunks=1)
    assert (other.mode, other.chunks, other.tag, other.q) == ("ulysses", 1, 3, q)
    assert (call.mode, call.chunks) == ("agkv", 2)
    with pytest.raises(TypeError, match=r"Call.replace: no fields \['chunk'\]"):
        call.replace(chunk=1)
