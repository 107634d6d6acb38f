"""The eager plan of ``cp_ops.attention(..., seq_lens=, key_mask=)`` (cp_ops.plan.flat.Plan with a
cp_ops.layout.Shards): a repeat call reuses its plan (no input checks, one rank-contract exchange), another ``seq_lens`` or
mask shape builds another plan, a mask whose values change between calls of one shape is honoured exactly, and the
plan's output is bitwise the general path's (the ops) for AGKV and Ulysses, B = 1 and 2, uneven and full blocks,
a rank with no token. CPU gloo, W = 2 and 3."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import cp_ops
from cp_ops import layout
from dist_util import run_ranks


class _Passthrough(TorchDispatchMode):
    """Any active dispatch mode sends cp_ops.attention to its general path (the ops)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _data(b, total, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, total, h, d, generator=g) for _ in range(3))
    mask = torch.rand(b, total, generator=g) > 0.4
    mask[:, 0] = True
    return q, k, v, mask


def _ref(q, k, v, mask, rank, w, seq, mode):
    """One device, the same SDPA calls as ``mode`` (with a mask on uneven shards: the padded sequence, masked)."""
    from test_uneven import _same_kernel_refs

    return _same_kernel_refs(q, k, v, mask, rank, w, seq, mode)


def _cache_and_masks(rank, w):
    from cp_ops import plan as A
    from cp_ops.plan import flat as F
    from cp_ops import contract as validate

    pg = dist.group.WORLD
    b, h, d = 2, 4, 8
    seq_a, seq_b = (7, 4), (5, 6)  # same total, another split
    q, k, v, _ = _data(b, 11, h, d, seed=5)
    A.forget()
    built = []
    orig_build, orig_checked = A._build, F.decide
    A._build = lambda call: built.append((call.mode, call.seq_lens)) or orig_build(call)

    def no_checks(*a):
        raise AssertionError("input checks ran on a cached call")

    try:
        for mode in ("agkv", "ulysses"):
            for seq in (seq_a, seq_b):
                sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
                for i in range(3):  # the mask's values change at every call, its shape does not
                    mask = torch.rand(b, 11, generator=torch.Generator().manual_seed(100 * i + len(built))) > 0.5
                    mask[:, 3] = True
                    n = validate.call_count(pg)
                    out = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, seq_lens=seq, key_mask=sh(mask))
                    assert validate.call_count(pg) == n + 1, "one exchange per call"  # first call too
                    assert torch.equal(out, _ref(q, k, v, mask, rank, w, seq, mode)), (mode, seq, i)
                    F.decide = no_checks  # from the second call on: the plan, no checks
                F.decide = orig_checked
                # without a mask: another key, another plan; then cached too
                for _ in range(2):
                    out = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, seq_lens=seq)
                    assert torch.equal(out, _ref(q, k, v, None, rank, w, seq, mode))
                    F.decide = no_checks
                F.decide = orig_checked
        # one plan per (mode, seq_lens, mask given): built once each
        assert built == [(m, s) for m in ("agkv", "ulysses") for s in (seq_a, seq_a, seq_b, seq_b)], built
    finally:
        A._build, F.decide = orig_build, orig_checked
    # a list of the same counts hits the tuple's plan; 4.0 is not a token count, even where (4, ...) is cached
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq_a)  # noqa: E731
    out = cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", seq_lens=list(seq_a))
    assert torch.equal(out, _ref(q, k, v, None, rank, w, seq_a, "agkv"))
    with pytest.raises(ValueError, match="seq_lens must hold ints; got float"):
        cp_ops.attention(sh(q), sh(k), sh(v), mode="agkv", seq_lens=tuple(float(n) for n in seq_a))
    # ranks whose cached plans disagree on seq_lens (equal padded shapes): every rank raises, naming both
    seq_c = (7, 3)
    xa, xc = torch.randn(1, seq_a[rank], h, d), torch.randn(1, seq_c[rank], h, d)
    for _ in range(2):
        cp_ops.attention(xa, xa, xa, mode="agkv", seq_lens=seq_a)
        cp_ops.attention(xc, xc, xc, mode="agkv", seq_lens=seq_c)
    x, seq = (xa, seq_a) if rank == 0 else (xc, seq_c)
    with pytest.raises(ValueError, match=r"differ in variant.*seq_lens=\[7, 4\].*seq_lens=\[7, 3\]"):
        cp_ops.attention(x, x, x, mode="agkv", seq_lens=seq)


def _lean_equals_general(rank, w):
    """The plan and the general path (the ops, taken under any dispatch mode) give the same bits, with the torch
    transport (its collectives called directly) and a transport object with pooled outputs (tests/pooled_transport:
    the path the fast transport takes)."""
    from pooled_transport import install

    install()
    cases = {2: [(1, 4, 8, (9, 4)), (2, 4, 8, (6, 6)), (2, 2, 8, (0, 5)), (1, 2, 4, (3, 3))],
             3: [(1, 6, 8, (5, 0, 7)), (2, 3, 8, (4, 4, 3))]}[w]
    for i, (b, h, d, seq) in enumerate(cases):
        q, k, v, mask = _data(b, sum(seq), h, d, seed=40 + i)
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq).contiguous()  # noqa: E731
        for mode, tr in [(m, t) for m in (("agkv", "ulysses") if h % w == 0 else ("agkv",))
                         for t in ("torch", "pooled_test")]:
            for kw in (dict(seq_lens=seq), dict(seq_lens=seq, key_mask=sh(mask)),
                       dict(key_mask=sh(mask)) if len(set(seq)) == 1 else dict(seq_lens=list(seq))):
                lean = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, transport=tr, **kw)
                with _Passthrough():
                    general = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, transport=tr, **kw)
                assert lean.shape == general.shape and lean.is_contiguous()
                assert torch.equal(lean, general), (mode, tr, b, seq, sorted(kw))
                m = kw.get("key_mask")
                assert torch.equal(lean, _ref(q, k, v, None if m is None else mask, rank, w, seq, mode))
    # nothing to move on any rank: the general path (an empty output)
    e = torch.randn(1, 0, 2 * w, 4)
    assert cp_ops.attention(e, e, e, mode="ulysses", seq_lens=(0,) * w).shape == e.shape


def _plan_w2(rank, w):
    _cache_and_masks(rank, w)
    _lean_equals_general(rank, w)


def test_plan_cached_masks_exact_and_equal_to_the_ops():
    run_ranks(_plan_w2, 2)


def test_plan_equal_to_the_ops_w3():
    run_ranks(_lean_equals_general, 3)
