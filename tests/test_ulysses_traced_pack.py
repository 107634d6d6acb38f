"""Ulysses under torch.compile packs its send buffer in traced torch code (cp_ops.layout.ulysses_pack_traced) and
moves it with ``cp_ops::ulysses_packed_start`` (cp_ops.comm.OpComm.ulysses; the overlap pass splits it into K/V and Q
launches): on real 2-rank gloo groups, compiled = eager bitwise (the same bytes reach the same attention calls) and
= single-device SDPA, at chunks 1 and 2 (pipelined sub-groups), even and uneven shards, with and without a key mask,
with one rank eager and the other compiled (one launch each: the same rank contract and collectives)."""

import torch
import torch.distributed as dist

import cp_ops
from cp_ops import layout
from cp_ops.kernels import local_attention as masked_attention
from dist_util import run_ranks


def _cases(rank, w):
    pg = dist.group.WORLD
    b, h, d = 1, 4 * w, 8
    graphs = []

    def backend(gm, example_inputs):  # Dynamo + AOTAutograd's graph, run as traced: the traced path, cheap on CPU
        from torch._dynamo.backends.common import aot_autograd

        graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    for seed, (total, masked, chunks) in enumerate([(16, False, 1), (16, False, 2), (13, True, 1), (16, True, 1)]):
        seq = layout.shard_sizes(total, w)
        g = torch.Generator().manual_seed(1000 + seed)  # the same full inputs on every rank, fresh per case
        q, k, v = (torch.randn(b, total, h, d, generator=g) for _ in range(3))
        mask = torch.rand(b, total, generator=g) > 0.4 if masked else None
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
        kw = {"seq_lens": seq} if total % w else {}
        if masked:
            kw["key_mask"] = sh(mask)

        def fn(q, k, v):
            return cp_ops.attention(q, k, v, group=pg, mode="ulysses", chunks=chunks, **kw)

        with torch.no_grad():
            eager = fn(sh(q), sh(k), sh(v))
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, backend=backend)(sh(q), sh(k), sh(v))
        assert torch.equal(compiled, eager), (total, masked, chunks, (compiled - eager).abs().max().item())
        ref = sh(masked_attention(q, k, v, None, mask))  # one device, all keys
        torch.testing.assert_close(eager, ref, rtol=1e-5, atol=1e-5)
        assert ref.abs().max() > 0.1
        launches = [n for n in graphs[-1].graph.nodes if n.op == "call_function" and "ulysses" in str(n.target)]
        names = [str(n.target).split(".")[1] for n in launches]  # per sub-group: one packed launch; the inverse(s)
        assert names.count("ulysses_packed_start") == min(chunks, h // w), names
        assert "ulysses_start" not in names, names
        with torch.no_grad():  # this rank eager, the peer compiled: the same launches
            mixed = fn(sh(q), sh(k), sh(v)) if rank == 0 else torch.compile(fn, fullgraph=True, backend=backend)(
                sh(q), sh(k), sh(v))
        assert torch.equal(mixed, eager)
    # uneven without a mask: the prefix split (layout.shard_sizes' (7, 6)) attends views of the received rows and
    # re-pads the output with one pad (no cat in the traced graph); the short block first, (6, 7), selects the real
    # rows (a cat per slot) and re-pads by cat: the same values either way
    total = 13
    g = torch.Generator().manual_seed(77)
    q, k, v = (torch.randn(b, total, h, d, generator=g) for _ in range(3))
    for seq in ((7, 6), (6, 7)):
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731

        def fn(q, k, v):
            return cp_ops.attention(q, k, v, group=pg, mode="ulysses", seq_lens=seq)

        with torch.no_grad():
            eager = fn(sh(q), sh(k), sh(v))
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, backend=backend)(sh(q), sh(k), sh(v))
        assert torch.equal(compiled, eager), (seq, (compiled - eager).abs().max().item())
        torch.testing.assert_close(eager, sh(masked_attention(q, k, v)), rtol=1e-5, atol=1e-5)
        cats = [n for n in graphs[-1].graph.nodes if n.target in (torch.cat, torch.index_select)]
        assert (len(cats) == 0) == (seq == layout.shard_sizes(total, w)), (seq, [n.target for n in cats])


def test_traced_pack_compiled_equals_eager_and_single_device():
    run_ranks(_cases, 2)


def _every_key_mask(rank, w):
    """A key mask of every key (``[B, S_total]``, rank order, the same on every rank) is applied as given: bitwise
    the output of this rank's mask gathered (the same kernel on the same keys and mask), eager and traced, with no
    mask gather; a wrong width names both shapes; ranks passing different kinds raise on every rank."""
    import pytest

    pg = dist.group.WORLD
    gathers = []
    orig = layout.Shards.pad_mask
    layout.Shards.pad_mask = lambda self, m: (gathers.append(1), orig(self, m))[1]
    try:
        for seed, (total, mode) in enumerate([(12, "ulysses"), (11, "ulysses"), (11, "agkv"), (12, "agkv")]):
            b, h, d = 2, 2 * w, 8
            seq = layout.shard_sizes(total, w)
            g = torch.Generator().manual_seed(2000 + seed)
            q, k, v = (torch.randn(b, total, h, d, generator=g) for _ in range(3))
            mask = torch.rand(b, total, generator=g) > 0.4
            sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
            kw = {"seq_lens": seq} if total % w else {}

            def fn(q, k, v, m):
                return cp_ops.attention(q, k, v, group=pg, mode=mode, chunks=1, key_mask=m, **kw)

            with torch.no_grad():
                gathers.clear()
                local = fn(sh(q), sh(k), sh(v), sh(mask))
                assert gathers, "the local mask was not gathered"
                gathers.clear()
                every = fn(sh(q), sh(k), sh(v), mask)
                torch._dynamo.reset()
                traced = torch.compile(fn, fullgraph=True, backend="aot_eager")(sh(q), sh(k), sh(v), mask)
            assert gathers == [], (total, mode)
            assert torch.equal(every, local) and torch.equal(traced, local), (total, mode)
            torch.testing.assert_close(local, sh(masked_attention(q, k, v, None, mask)), rtol=1e-5, atol=1e-5)
        # one rank holds every token (seq_lens (5, 0)): its own mask is every key's; the empty rank may pass either
        # [B, 0] or [B, 5] (was: the ranks' variants differed, 'given' vs 'every key', and every rank raised)
        seq = (5,) + (0,) * (w - 1)
        g = torch.Generator().manual_seed(2100)
        q, k, v = (torch.randn(2, 5, 2 * w, 8, generator=g) for _ in range(3))
        mask = torch.rand(2, 5, generator=g) > 0.4
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
        for mode in ("ulysses", "agkv"):
            def fn(q, k, v, m):
                return cp_ops.attention(q, k, v, group=pg, mode=mode, chunks=1, seq_lens=seq, key_mask=m)

            with torch.no_grad():
                local = fn(sh(q), sh(k), sh(v), sh(mask))
                every = fn(sh(q), sh(k), sh(v), mask)
                torch._dynamo.reset()
                traced = torch.compile(fn, fullgraph=True, backend="aot_eager")(sh(q), sh(k), sh(v), mask)
            assert torch.equal(every, local) and torch.equal(traced, local), mode
            ref = sh(masked_attention(q, k, v, None, mask))
            torch.testing.assert_close(local, ref, rtol=1e-5, atol=1e-5)
            assert rank != 0 or ref.abs().max() > 0.1
        x = torch.randn(1, 6, 2 * w, 8)
        with pytest.raises(ValueError, match=r"\[B, S_local\] = \[1, 6\].*or \[B, S_total\] = \[1, 12\].*got shape \(1, 7\)"):
            cp_ops.attention(x, x, x, group=pg, mode="ulysses", key_mask=torch.ones(1, 7, dtype=torch.bool))
        # rank 0 passes every key's mask, rank 1 its own: every rank raises (the variant differs), none hangs
        m = torch.ones(1, 12, dtype=torch.bool) if rank == 0 else torch.ones(1, 6, dtype=torch.bool)
        with pytest.raises(ValueError, match="every key"):
            cp_ops.attention(x, x, x, group=pg, mode="ulysses", key_mask=m)
    finally:
        layout.Shards.pad_mask = orig


def test_every_key_mask_equals_gathered_mask():
    run_ranks(_every_key_mask, 2)


def _with_the_pass(gm, example_inputs):
    """Dynamo + AOTAutograd's forward graph with cp_ops' overlap pass applied (as Inductor applies it post-grad),
    run as traced: the pass's split (K/V and Q launched apart) without Inductor's codegen (CI time)."""
    from torch._dynamo.backends.common import aot_autograd

    from passes import OverlapPass

    def fw(g, _):
        OverlapPass()(g.graph)
        g.recompile()
        return g

    return aot_autograd(fw_compiler=fw)(gm, example_inputs)


def _pass_split_with_eager_peer(rank, w):
    """Under the overlap pass a Ulysses call sends K/V and Q apart (two all-to-alls), the eager path and a compile
    without the pass send the call's buffer whole (one): every rank compiled with the pass = eager bitwise; one rank
    eager, its peer with the pass: every rank raises naming the split (was: all-to-alls of different sizes, gloo
    aborted the process: 'Received data size doesn't match expected size'); the group works after."""
    import pytest

    pg = dist.group.WORLD
    g = torch.Generator().manual_seed(3000)
    q, k, v = (torch.randn(1, 8 * w, 2 * w, 8, generator=g) for _ in range(3))
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731

    def fn(q, k, v):
        return cp_ops.attention(q * 2, k + 1, v, group=pg, mode="ulysses", chunks=1)

    torch._dynamo.reset()
    with torch.no_grad():
        eager = fn(sh(q), sh(k), sh(v))
        compiled = torch.compile(fn, fullgraph=True, backend=_with_the_pass)
        assert torch.equal(compiled(sh(q), sh(k), sh(v)), eager)
        with pytest.raises(ValueError, match="sent apart by cp_ops.compile's overlap pass"):
            fn(sh(q), sh(k), sh(v)) if rank == 0 else compiled(sh(q), sh(k), sh(v))
        assert torch.equal(fn(sh(q), sh(k), sh(v)), eager)
    torch.testing.assert_close(eager, sh(masked_attention(q * 2, k + 1, v, None, None)), rtol=1e-5, atol=1e-5)


def test_pass_split_with_an_eager_peer_raises_on_every_rank():
    run_ranks(_pass_split_with_eager_peer, 2)
