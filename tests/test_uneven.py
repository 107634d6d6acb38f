"""Uneven shards (``seq_lens``) and key-padding masks (``key_mask``) in cp_ops.attention and the collectives, on
real gloo groups (W = 2, 3, 4): equal to single-device SDPA on the concatenation (bitwise at chunks=1), rank
disagreement and bad inputs raise on every rank, torch.compile(fullgraph=True) = eager, opcheck on the new ops. Marked gpu (skipped
without 2 GPUs): the same on NCCL, one GPU a rank."""

import contextlib

import pytest
import torch
import torch.distributed as dist

import cp_ops
from cp_ops import config, layout
from cp_ops.kernels import local_attention as masked_attention
from dist_util import run_ranks
from inductor_mode import inductor_kernels

# (B, H, D, split): split = a total token count (cp_ops.layout.shard_sizes: a prefix split, the real rows taken as a
# view) or explicit seq_lens (some not a prefix: (0, 9), (5, 0, 12), (1, 1, 30), (1, 10, 0, 3), (4, 4, 3, 3): the rows selected)
CASES = {
    2: [(1, 4, 8, 7), (2, 2, 16, 31), (1, 4, 8, (0, 9)), (2, 6, 8, (13, 2))],
    3: [(1, 3, 8, 95), (2, 6, 8, 20), (1, 3, 16, (5, 0, 12)), (1, 6, 8, (1, 1, 30))],
    4: [(1, 4, 8, 30), (2, 8, 8, 13), (1, 4, 8, (1, 10, 0, 3)), (1, 2, 8, (6, 6, 6, 5)), (2, 8, 8, (4, 4, 3, 3))],
}


def _data(b, total, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, total, h, d, generator=g) for _ in range(3))
    mask = torch.rand(b, total, generator=g) > 0.35
    mask[:, 0] = True  # no batch row without a key here (that case is checked on its own below)
    return q, k, v, mask


def _padded(t, seq):
    """``[B, total, ...]`` → ``[B, W*max(seq), ...]``: every rank's block padded to ``max(seq)`` rows with zeros
    (False for a mask): the sequence a masked call on uneven shards attends (cp_ops.layout.Shards)."""
    smax, parts, off = max(seq), [], 0
    for n in seq:
        parts += [t[:, off:off + n], t.new_zeros(t.shape[0], smax - n, *t.shape[2:])]
        off += n
    return torch.cat(parts, dim=1)


def _same_kernel_refs(q, k, v, mask, rank, w, seq, mode, scale=None):
    """What one device computes for this rank's rows with the kernel calls of ``mode``: AGKV attends this rank's
    queries against all keys; Ulysses attends each head group over the full sequence. With a mask on uneven
    shards, the sequence attended is the padded one (zeros, masked). (CPU SDPA's result for a row may depend on the
    query count and the head count of the call — by ~1e-7 at some shapes — so "the same kernel sees the same data"
    means the same calls.)"""
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
    padded = mask is not None and len(set(seq)) > 1
    if padded:
        smax = max(seq)
        q, k, v, mask = (_padded(t, seq) for t in (q, k, v, mask))
        sh = lambda t: t[:, rank * smax:rank * smax + seq[rank]]  # noqa: E731
    if mode == "agkv":
        return masked_attention(sh(q), k, v, scale, mask)
    hl = q.shape[2] // w
    groups = [masked_attention(*(t[:, :, g * hl:(g + 1) * hl] for t in (q, k, v)), scale, mask) for g in range(w)]
    return sh(torch.cat(groups, dim=2))


def _case_equal_to_single_device(rank, w, i):
    """CASES[w][i] through each mode, with and without a key mask, chunks 1 (bitwise) and 2, 3."""
    pg = dist.group.WORLD
    b, h, d, split = CASES[w][i]
    seq = layout.shard_sizes(split, w) if isinstance(split, int) else split
    total = sum(seq)
    q, k, v, mask = _data(b, total, h, d, seed=100 * w + i)
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
    assert sh(q).shape[1] == seq[rank]
    ref = sh(cp_ops.local_attention(q, k, v))  # one device, one call
    ref_m = sh(masked_attention(q, k, v, key_mask=mask))
    assert ref.numel() == 0 or not torch.equal(ref, ref_m)  # the mask matters in these cases
    modes = ["agkv", "ulysses"] if h % w == 0 else ["agkv"]
    for mode in modes:
        for m, full in ((None, ref), (mask, ref_m)):
            out = cp_ops.attention(sh(q), sh(k), sh(v), group=pg, mode=mode, chunks=1, seq_lens=seq,
                                   key_mask=None if m is None else sh(m))
            assert out.shape == full.shape and out.is_contiguous()
            # the same kernel calls see the same keys (padded rows removed before SDPA; with a mask, the
            # padded sequence, masked): bitwise
            same = _same_kernel_refs(q, k, v, m, rank, w, seq, mode)
            assert torch.equal(out, same), (mode, seq, m is not None, (out - same).abs().max().item())
            torch.testing.assert_close(out, full, rtol=1e-6, atol=1e-6)
            # pipelined: AGKV (LSE merge: not bitwise) without a mask, Ulysses (exact per head) with or without
            for chunks in (2, 3):
                if mode == "agkv" and m is not None:
                    continue
                out = cp_ops.attention(sh(q), sh(k), sh(v), group=pg, mode=mode, chunks=chunks, seq_lens=seq,
                                       key_mask=None if m is None else sh(m))
                # (Ulysses attends fewer heads per SDPA call: CPU SDPA differs by ~1e-7, so not bitwise)
                torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)


def _masked_even_shards(rank, w):
    # a key mask on even shards (seq_lens=None), bf16, a batch row whose keys are all masked (SDPA's answer: 0 on
    # CPU), a custom scale
    b, s, h, d = 2, 8 * w, 12, 8
    q, k, v, mask = _data(b, s, h, d, seed=7)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    mask[1] = False
    even = (8,) * w
    full = layout.shard(masked_attention(q, k, v, 0.3, mask), 1, rank, w)
    assert torch.equal(full[1], torch.zeros_like(full[1]))
    for mode in ("agkv", "ulysses"):
        out = cp_ops.attention(*(layout.shard(t, 1, rank, w) for t in (q, k, v)), mode=mode, scale=0.3,
                               key_mask=layout.shard(mask, 1, rank, w))
        same = _same_kernel_refs(q, k, v, mask, rank, w, even, mode, 0.3)
        assert out.dtype == torch.bfloat16 and torch.equal(out, same), mode
        torch.testing.assert_close(out, full)


def _collectives(rank, w):
    seq = {2: (5, 2), 3: (4, 0, 7), 4: (3, 3, 1, 6)}[w]
    b, h, d = 2, 2 * w, 4
    q, k, v, _ = _data(b, sum(seq), h, d, seed=w)
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
    kf, vf = cp_ops.agkv_gather(sh(k), sh(v), seq_lens=seq)
    assert torch.equal(kf, k) and torch.equal(vf, v)
    hl = h // w
    heads = slice(rank * hl, (rank + 1) * hl)
    qh, kh = cp_ops.ulysses_all_to_all(sh(q), sh(k), seq_lens=seq)
    assert torch.equal(qh, q[:, :, heads]) and torch.equal(kh, k[:, :, heads])
    back = cp_ops.ulysses_all_to_all_inverse(qh * 2, seq_lens=seq)
    assert torch.equal(back, sh(q) * 2)
    # the standard split through layout.shard (no seq_lens to shard) and even seq_lens
    total = 4 * w + 1
    x = torch.arange(total * h * 2, dtype=torch.float32).view(1, total, h, 2)
    got, _ = cp_ops.agkv_gather(layout.shard(x, 1, rank, w), layout.shard(x, 1, rank, w),
                                seq_lens=layout.shard_sizes(total, w))
    assert torch.equal(got, x)
    even = (4,) * w
    x = x[:, : 4 * w]
    got, _ = cp_ops.agkv_gather(x[:, 4 * rank: 4 * rank + 4], x[:, 4 * rank: 4 * rank + 4], seq_lens=even)
    assert torch.equal(got, x)


@pytest.mark.parametrize("world_size,case", [(w, i) for w in sorted(CASES) for i in range(len(CASES[w]))])
def test_uneven_and_masked_equal_single_device(world_size, case):
    run_ranks(_case_equal_to_single_device, world_size, case)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_masked_even_shards_and_collectives(world_size):
    run_ranks(_masked_even_and_collectives, world_size)


def _masked_even_and_collectives(rank, w):
    _masked_even_shards(rank, w)
    _collectives(rank, w)


def _errors(rank, w):
    x = torch.randn(1, 4 - rank, 2, 4)  # rank 0 holds 4 tokens, rank 1 holds 3
    good = (4, 3)

    def raises(match, **kw):
        with pytest.raises(ValueError, match=match):
            cp_ops.attention(x, x, x, mode=kw.pop("mode", "agkv"), **kw)

    # every rank passes the same bad argument: each raises its own error
    raises(r"one token count per rank .*world_size=2.*got 3", seq_lens=(4, 3, 0))
    raises(r"non-negative token counts; got \[4, -1\]", seq_lens=(4, -1))
    raises(r"seq_lens must hold ints; got float", seq_lens=(4.0, 3))
    raises(r"seq_lens must be a tuple", seq_lens=7)
    raises(r"seq_lens\[rank\] must equal .*seq_lens=\[3, 4\], rank=%d, S_local=%d" % (rank, 4 - rank),
           seq_lens=(3, 4))
    raises(r"mode='agkv' with chunks > 1 takes no key_mask.*chunks=2", seq_lens=good, chunks=2,
           key_mask=torch.ones(1, 4 - rank, dtype=torch.bool))
    raises(r"key_mask must be a bool key-padding mask .*additive float masks are not supported; got dtype torch.float32",
           seq_lens=good, key_mask=torch.zeros(1, 4 - rank))
    raises(r"key_mask must be \[B, S_local\] = \[1, %d\] .*per-query.*got shape \(1, 1, %d\)" % (4 - rank, 4 - rank),
           seq_lens=good, key_mask=torch.ones(1, 1, 4 - rank, dtype=torch.bool))
    raises(r"key_mask must be a bool tensor", key_mask=[True] * (4 - rank), seq_lens=good)
    # one rank's bad input: the peer raises too (no hang), naming the rank that rejected its inputs
    raises(r"seq_lens\[rank\] must equal" if rank == 1 else r"rank\(s\) \[1\] .* rejected their inputs",
           seq_lens=(4, 4) if rank == 1 else good)
    # ranks that disagree on seq_lens with equal padded shapes: every rank raises, naming each rank's seq_lens
    for mode in ("agkv", "ulysses"):
        raises(r"differ in variant.*rank 0: .*seq_lens=\[4, 2\].*rank 1: .*seq_lens=\[4, 3\]", mode=mode,
               seq_lens=(4, 2) if rank == 0 else (4, 3))
    # a mask on one rank only
    raises(r"differ in .*key_mask=given.*key_mask=None|differ in .*key_mask=None.*key_mask=given",
           seq_lens=good, key_mask=torch.ones(1, 4 - rank, dtype=torch.bool) if rank == 0 else None)
    # the collectives
    with pytest.raises(ValueError, match=r"sum\(seq_lens\) must equal .*x.shape\[1\]=5"):
        cp_ops.ulysses_all_to_all_inverse(torch.randn(1, 5, 1, 4), seq_lens=good)
    with pytest.raises(ValueError, match=r"differ in .*variant.*seq_lens=\[4, 3\].*seq_lens=\[5, 2\]"):
        cp_ops.ulysses_all_to_all_inverse(torch.randn(1, 7, 1, 4), seq_lens=(4, 3) if rank == 0 else (5, 2))
    # still in step: a good call works
    out = cp_ops.attention(x, x, x, mode="ulysses", seq_lens=good)
    assert out.shape == x.shape


def _errors_and_opcheck(rank, w):
    _errors(rank, w)
    _opcheck(rank, w)


def test_errors_raise_on_every_rank_and_opcheck():
    run_ranks(_errors_and_opcheck, 2)


def _compiled(rank, w):
    seq = layout.shard_sizes(11, w)  # (6, 5) on W = 2
    b, h, d = 2, 2 * w, 8
    proj = torch.nn.Linear(h * d, 3 * h * d)
    torch.manual_seed(0)
    for p in proj.parameters():
        torch.nn.init.normal_(p)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(b, seq[rank], h * d, generator=g)
    mask = torch.rand(b, seq[rank], generator=g) > 0.3

    def block(x, mask, mode):
        q, k, v = (t.unflatten(-1, (h, d)) for t in proj(x).chunk(3, dim=-1))
        return cp_ops.attention(q, k, v, mode=mode, seq_lens=seq, key_mask=mask).flatten(-2) * 2

    def both(x, mask):  # the modes are calls of one function: one compile for both
        return [block(x, mask, mode) for mode in ("agkv", "ulysses")]

    with torch.no_grad():
        eager = both(x, mask)
        compiled = torch.compile(both, fullgraph=True)(x, mask)
    for mode, got, want in zip(("agkv", "ulysses"), compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=mode)
        assert want.numel() == 0 or want.abs().max() > 0
    # a rank holding no token, this rank's mask, every key's and none (Ulysses then reads the real rows of each
    # slot), static or dynamic shapes: compiled = eager, bitwise. One compile per case: a graph of several calls on a
    # rank without tokens may be split differently from its peer's (the rank contract then raises, naming the call).
    # Dynamo + AOTAutograd (aot_eager: the ops' fake kernels under static and symbolic shapes, functionalization) for
    # every case; Inductor with the overlap pass (cp_ops.compile) where the pass has something to get wrong:
    # - dynamic AGKV with this rank's mask: seq_lens reach the launches (agkv_gather_start, mask_gather_start) as
    #   SymInt graph inputs, which the pass's pool-key grouping must not read as tensors (the grouping is one
    #   function for every launch op: test_pass_correctness's dynamic case runs it on Ulysses' launches);
    # - static Ulysses without a mask: the pass opens the window on uneven shards (the graph:
    #   test_pass_graph.test_uneven_ulysses_opens_a_window) and changes no bit.
    from torch import _dynamo

    seq = (0, 9) if w == 2 else (0,) + layout.shard_sizes(9, w - 1)
    x = torch.randn(b, seq[rank], h * d, generator=g)
    full = torch.rand(b, sum(seq), generator=g) > 0.3
    own = layout.shard(full, 1, rank, w, seq_lens=seq)

    def block2(x, mask, mode):
        q, k, v = (t.unflatten(-1, (h, d)) for t in proj(x).chunk(3, dim=-1))
        return cp_ops.attention(q, k, v, mode=mode, seq_lens=seq, key_mask=mask).flatten(-2) * 2

    with_pass = {("agkv", "own", True), ("ulysses", "none", False)}
    # every mask with both modes and both shape kinds, every mode with both shape kinds (pairs, not the full cube)
    cases = {("agkv", "own"): True, ("agkv", "full"): False, ("agkv", "none"): True,
             ("ulysses", "own"): False, ("ulysses", "full"): True, ("ulysses", "none"): False}
    for mode in ("agkv", "ulysses"):
        for name, m in (("own", own), ("full", full), ("none", None)):
            with torch.no_grad():
                eager = block2(x, m, mode)
                for dynamic in (cases[mode, name],):
                    _dynamo.reset()
                    kernels = (mode, name, dynamic) in with_pass
                    if kernels:
                        fn = cp_ops.compile(block2, fullgraph=True, dynamic=dynamic)
                    else:
                        fn = torch.compile(block2, fullgraph=True, dynamic=dynamic, backend="aot_eager")
                    with inductor_kernels() if kernels else contextlib.nullcontext():
                        compiled = fn(x, m, mode)
                    assert torch.equal(compiled, eager), (mode, name, dynamic)


def _dynamic(rank, w):
    """One graph for several uneven token counts under dynamic shapes (item 6 relies on it)."""
    import torch._dynamo

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def fn(x):
        seq = layout.shard_sizes(x.shape[1], w)
        xs = layout.shard(x, 1, rank, w)
        return cp_ops.attention(xs * 1.5, xs, xs, mode="agkv", seq_lens=seq)

    torch._dynamo.reset()
    cfn = torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)
    for total in (11, 13, 17):  # all uneven on W = 2
        x = torch.randn(1, total, 2, 8, generator=torch.Generator().manual_seed(total))
        with torch.no_grad():
            assert torch.equal(cfn(x), fn(x)), total
    assert len(graphs) == 1, f"{len(graphs)} graphs for 3 token counts"


def _empty_rank_pipelined(rank, w):
    """Pipelined AGKV compiled by Inductor on a rank without tokens (seq_lens (4, 0)): its output is empty, and
    Inductor computed the graph's empty result without the op (one ``empty``), so rank 1 never sent its block and
    rank 0 waited on it (before: the rank contract's mismatch at rank 1's next call, or a timeout). No FX graph or
    AOT cache: a graph cached before the op was marked side-effectful would keep the op out."""
    from torch import _dynamo
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    seq = (4, 0)
    x = torch.randn(2, sum(seq), 2, 8, generator=torch.Generator().manual_seed(11))
    xs = layout.shard(x, 1, rank, w, seq_lens=seq)

    def block(x):
        return cp_ops.attention(x * 1.5, x, x, mode="agkv", chunks=2, seq_lens=seq) * 2

    no_cache = inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False)
    with torch.no_grad(), no_cache[0], no_cache[1]:
        eager = block(xs)
        _dynamo.reset()
        compiled = torch.compile(block, fullgraph=True)(xs)
        # a call after it: the ranks are still in step (the rank contract raises, naming the calls, if not)
        after = cp_ops.attention(xs, xs, xs, mode="agkv", chunks=1, seq_lens=seq)
    assert compiled.shape == eager.shape == xs.shape
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
    torch.testing.assert_close(compiled, sh(cp_ops.local_attention(x * 1.5, x, x)) * 2)
    assert torch.equal(after, sh(cp_ops.local_attention(x, x, x)))


def _compiled_and_dynamic(rank, w):
    _compiled(rank, w)
    _dynamic(rank, w)
    _empty_rank_pipelined(rank, w)


def test_compiled_equals_eager():
    run_ranks(_compiled_and_dynamic, 2)


def _opcheck(rank, w):
    name = dist.group.WORLD.group_name
    config.settings.blocking = True  # opcheck compares outputs without waiting: launch blocking
    seq = [3, 2]
    g = torch.Generator().manual_seed(rank)
    pad = max(seq) - seq[rank]  # padded to max(seq_lens) with zeros (opcheck compares every row, padding too)
    k, v = (torch.nn.functional.pad(torch.randn(2, seq[rank], 4, 8, generator=g), (0, 0, 0, 0, 0, pad))
            for _ in range(2))
    mask = torch.nn.functional.pad((torch.rand(2, seq[rank], generator=g) > 0.5).to(torch.uint8), (0, pad))
    ops = torch.ops.cp_ops
    torch.library.opcheck(ops.agkv_gather_start, (k, v, w, name, "torch", "", 0, seq))
    torch.library.opcheck(ops.mask_gather_start, (mask, w, name))
    torch.library.opcheck(ops.ulysses_start, ([k, v], w, name, "torch", "", 0, seq))
    x = torch.randn(2, 6, 2, 8, generator=g)
    torch.library.opcheck(ops.ulysses_inverse_start, (x, w, name, "torch", "", 0, seq))
    ql, kl, vl = (torch.randn(2, seq[rank], 4, 8, generator=g) for _ in range(3))  # this rank's own rows
    torch.library.opcheck(ops.agkv_pipelined_attention, (ql, kl, vl, w, name, "torch", 0.5, 2, seq, "", 0))



def _masked_selects_nothing(rank, w):
    """With a key mask on uneven shards nothing is selected or re-padded (the padding is attended, masked): the
    selection methods are never called; without a mask they are (the exact path)."""
    seq = (5, 3)
    q, k, v, mask = _data(1, 8, 4, 8, seed=3)
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
    called = []
    saved = {n: getattr(layout.Shards, n) for n in ("rows", "ulysses_rows", "repad")}
    for n, f in saved.items():
        setattr(layout.Shards, n, lambda self, *a, _n=n, _f=f: called.append(_n) or _f(self, *a))
    try:
        for mode in ("agkv", "ulysses"):
            for m in (sh(mask), mask):  # this rank's mask (gathered), every key's (no gather)
                called.clear()
                out = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, seq_lens=seq, key_mask=m)
                assert called == [] and torch.equal(out, _same_kernel_refs(q, k, v, mask, rank, w, seq, mode))
            cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, seq_lens=seq)
            assert called, mode
    finally:
        for n, f in saved.items():
            setattr(layout.Shards, n, f)


def test_masked_uneven_selects_no_rows():
    run_ranks(_masked_selects_nothing, 2)


def test_shard_sizes():
    assert layout.shard_sizes(7, 2) == (4, 3)
    assert layout.shard_sizes(8423, 3) == (2808, 2808, 2807)
    assert layout.shard_sizes(32760, 6) == (5460,) * 6
    assert layout.shard_sizes(2, 4) == (1, 1, 0, 0)
    assert layout.shard_sizes(10, 4) == (3, 3, 3, 1)  # the prefix split (tensor_split: (3, 3, 2, 2))
    assert layout.shard_sizes(4481, 8) == (561,) * 7 + (554,)  # FLUX.1-dev 1008²'s 3969 + 512 tokens
    assert layout.shard_sizes(9, 4) == (3, 2, 2, 2)  # the prefix split would leave rank 3 empty: tensor_split's
    prefix_splits = 0
    for total in range(0, 80):
        for w in range(1, 9):
            sizes = layout.shard_sizes(total, w)
            smax = -(-total // w)
            split = tuple(t.shape[0] for t in torch.arange(total).tensor_split(w))
            if total - (w - 1) * smax >= 1:  # the prefix split: smax on every rank but the last
                assert sizes == (smax,) * (w - 1) + (total - (w - 1) * smax,), (total, w, sizes)
                prefix_splits += sizes != split
            elif total >= w:  # no rank left empty while another holds 2+ tokens: tensor_split's rule
                assert sizes == split, (total, w, sizes)
            else:
                assert sizes == split == (1,) * total + (0,) * (w - total)
            assert max(sizes) == max(split)  # the slowest rank's count: the same under both rules
            sh = layout.Shards(sizes, w, 0, sizes[0], torch.device("cpu"))
            assert sh.prefix == (total - (w - 1) * smax >= 1 or total < w), (total, w, sizes)
            x = torch.arange(total)
            assert torch.equal(torch.cat([layout.shard(x, 0, r, w) for r in range(w)]), x)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        layout.shard_sizes(4, 0)
    with pytest.raises(ValueError, match=r"total must be >= 0 tokens; got -1"):
        layout.shard_sizes(-1, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\); got 2"):
        layout.shard(torch.arange(4), 0, 2, 2)
    with pytest.raises(ValueError, match=r"summing to x.shape\[0\]=4; got \[1, 2\]"):
        layout.shard(torch.arange(4), 0, 0, 2, seq_lens=(1, 2))


def test_submodule_import_before_core_keeps_public_functions():
    """``import cp_ops`` before torch, then the submodule that defines ``cp_ops.attention`` (as a spawned rank does):
    ``cp_ops.attention`` and ``cp_ops.compile`` stay the functions (no submodule shares a public name, which the
    import system would bind over the function: test_import_graph)."""
    import os
    import subprocess
    import sys

    code = ("import sys, cp_ops; assert 'torch' not in sys.modules; from cp_ops.api import local_attention; import cp_ops.compiler; "
            "import types; assert callable(cp_ops.attention) and not isinstance(cp_ops.attention, types.ModuleType); "
            "assert callable(cp_ops.compile) and not isinstance(cp_ops.compile, types.ModuleType)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stderr


def test_masked_attention_positional_mask_is_a_clear_error():
    from cp_ops.kernels import local_attention as masked_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 2, 8, generator=g) for _ in range(3))
    mask = torch.rand(1, 4, generator=g) > 0.3
    with pytest.raises(TypeError, match=r"4th positional argument is scale .* pass the mask as key_mask=mask"):
        masked_attention(q, k, v, mask)
    got = masked_attention(q, k, v, key_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                                           attn_mask=mask[:, None, None, :]).transpose(1, 2)
    assert torch.equal(got, ref)


# ---- GPU (uneven shards and key masks on NCCL; marked gpu, skipped without the GPUs; formerly tests/test_uneven_gpu.py) ----
# GPU tests of uneven shards and key-padding masks (NCCL, one GPU per rank, bf16): run on the GPU machine;
# skipped without 2 CUDA GPUs. Equal to one GPU for the same SDPA calls (bitwise), close to one SDPA call over the
# whole sequence, for both transports ('torch' and 'auto': the fast one where it runs), eager and compiled.
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _refs(q, k, v, mask, rank, w, seq, mode):
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq).contiguous()  # noqa: E731
    if mask is not None and len(set(seq)) > 1:  # the padded sequence, masked (_same_kernel_refs)
        smax = max(seq)
        q, k, v, mask = (_padded(t, seq) for t in (q, k, v, mask))
        sh = lambda t: t[:, rank * smax:rank * smax + seq[rank]].contiguous()  # noqa: E731
    if mode == "agkv":
        return masked_attention(sh(q), k, v, None, mask)
    hl = q.shape[2] // w
    groups = [masked_attention(*(t[:, :, g * hl:(g + 1) * hl].contiguous() for t in (q, k, v)), None, mask)
              for g in range(w)]
    return sh(torch.cat(groups, dim=2))


def _cuda_uneven(rank, w):
    dev = torch.device("cuda", rank)
    b, h, d = 2, 8, 128
    for seq in (layout.shard_sizes(4097, w), (3000, 1097), (4096, 0)):
        total = sum(seq)
        g = torch.Generator(device=dev).manual_seed(total + seq[0])
        q, k, v = (torch.randn(b, total, h, d, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
        mask = torch.ones(b, total, dtype=torch.bool, device=dev)
        mask[0, -300:] = False  # text-style padding at the end of row 0
        mask[1] = torch.rand(total, generator=g, device=dev) > 0.2
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq).contiguous()  # noqa: E731
        for m in (None, mask):
            full = sh(masked_attention(q, k, v, None, m))  # one SDPA call over the whole sequence
            for mode in ("agkv", "ulysses"):
                same = _refs(q, k, v, m, rank, w, seq, mode)
                for transport in ("torch", "auto"):
                    out = cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, transport=transport, seq_lens=seq,
                                           key_mask=None if m is None else sh(m))
                    torch.cuda.synchronize()
                    err = (out.float() - full.float()).abs().max().item() if out.numel() else 0.0
                    print(f"rank {rank} seq={seq} mask={m is not None} {mode} {transport}: "
                          f"bitwise(same calls)={torch.equal(out, same)} max abs err vs one call={err:.3e}")
                    assert torch.equal(out, same), (seq, mode, transport, m is not None)
                    torch.testing.assert_close(out, full, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@TWO_GPUS
def test_cuda_uneven_and_masked_equal_single_gpu():
    run_ranks(_cuda_uneven, 2, device="cuda")


def _cuda_compiled(rank, w):
    dev = torch.device("cuda", rank)
    seq = layout.shard_sizes(2049, w)
    g = torch.Generator(device=dev).manual_seed(rank)
    q, k, v = (torch.randn(1, seq[rank], 8, 64, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.rand(1, seq[rank], generator=g, device=dev) > 0.1
    for mode in ("agkv", "ulysses"):
        fn = lambda q, k, v, m: cp_ops.attention(q * 1.5, k, v, mode=mode, seq_lens=seq, key_mask=m)  # noqa: E731
        torch.testing.assert_close(torch.compile(fn, fullgraph=True)(q, k, v, mask), fn(q, k, v, mask), rtol=0, atol=0)


@pytest.mark.gpu
@TWO_GPUS
def test_cuda_uneven_compiled_equals_eager():
    run_ranks(_cuda_compiled, 2, device="cuda")


@pytest.mark.parametrize("seq", [(862,) + (861,) * 7, (6, 5), (4, 4, 3, 3), (3, 3, 3, 2), (6, 6, 6, 5),
                                 (1, 10, 0, 3), (5, 0, 12), (2, 1, 1, 1), (1, 1, 0, 0)])
def test_repad_traced_equals_eager_and_is_two_parts_on_standard_splits(seq):
    """Shards.repad under torch.compile (the traced form) = the eager index_select on every real row, zeros in the
    padding; on a prefix split (layout.shard_sizes') one pad at the end, no cat; on tensor_split's split the traced
    graph cats at most 2 parts (it catted 2W - 1: 15 one-copy kernels per call on Qwen-Image at W = 8 under CUDA
    graphs)."""
    w, total = len(seq), sum(seq)
    sh = layout.Shards(seq, w, 0, seq[0], torch.device("cpu"))
    out = torch.randn(2, total, 3, 4, generator=torch.Generator().manual_seed(total))
    cats = []

    def backend(gm, example_inputs):
        cats.extend(len(n.args[0]) for n in gm.graph.nodes if n.target is torch.cat)
        return gm

    torch._dynamo.reset()
    traced = torch.compile(sh.repad, backend=backend, fullgraph=True)(out)
    eager = sh.repad(out)
    assert traced.shape == eager.shape == (2, w * sh.smax, 3, 4)
    real = torch.cat([torch.arange(r * sh.smax, r * sh.smax + n) for r, n in enumerate(seq)])
    pad = torch.tensor([i for i in range(w * sh.smax) if i not in set(real.tolist())], dtype=torch.long)
    assert torch.equal(traced[:, real], eager[:, real]) and torch.equal(traced[:, real], out)
    assert torch.count_nonzero(traced[:, pad]) == 0
    if sh.prefix:  # the prefix split (layout.shard_sizes): one pad at the end, eager and traced, no cat
        assert not cats and torch.equal(eager, traced), (seq, cats)
    elif seq == tuple(t.shape[0] for t in torch.arange(total).tensor_split(w)) and sh.smax > 1:
        assert cats and max(cats) <= 2, f"tensor_split's split {seq}: cat of {cats} parts"
