"""Public results never alias a transport's pooled receive buffers (emulated on CPU by a registered test
transport whose outputs are views of persistent slots, like the fast transport's)."""

import torch

import cp_ops
from dist_util import run_ranks
from pooled_transport import install


def _shard(t, rank, w):
    s = t.shape[1] // w
    return t[:, rank * s:(rank + 1) * s]


def _aliases(out, pool):
    p = out.untyped_storage().data_ptr()
    return any(p == buf.untyped_storage().data_ptr() for buf in pool.receive_buffers())


def _data(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(3)]


def _public_outputs_are_owned(rank, w):
    pool = install()
    assert "pooled_test" in cp_ops.transport.names()  # the registry takes a transport from a test file
    tr = "pooled_test"
    # B*S_local = 1 is the shape where Ulysses' last unpack used to be a view; B = 1 / 2 the all-to-all's
    for b, s in ((1, w), (1, 4 * w), (2, 2 * w)):
        h, d = 2 * w, 8
        q, k, v = _data((b, s, h, d), seed=s + b)
        q2, k2, v2 = _data((b, s, h, d), seed=100 + s + b)  # a second call of the same shape refills the slots
        sq, sk, sv = (_shard(t, rank, w) for t in (q, k, v))
        s2 = [_shard(t, rank, w) for t in (q2, k2, v2)]
        ref = _shard(cp_ops.local_attention(q, k, v), rank, w)
        for mode in ("agkv", "ulysses"):
            same = cp_ops.attention(sq, sk, sv, mode=mode, transport="torch")  # same kernels, fresh buffers
            torch.testing.assert_close(same, ref, rtol=1e-5, atol=1e-5)
            out = cp_ops.attention(sq, sk, sv, mode=mode, transport=tr)
            assert not _aliases(out, pool), (mode, b, s)
            cp_ops.attention(*s2, mode=mode, transport=tr)
            assert torch.equal(out, same), (mode, b, s)  # still this call's numbers after the next call

        kf, vf = cp_ops.agkv_gather(sk, sv, transport=tr)
        assert not _aliases(kf, pool) and not _aliases(vf, pool)
        cp_ops.agkv_gather(s2[1], s2[2], transport=tr)
        assert torch.equal(kf, k) and torch.equal(vf, v)

        hl = h // w
        outs = cp_ops.ulysses_all_to_all(sq, sk, transport=tr)
        assert not any(_aliases(o, pool) for o in outs)
        cp_ops.ulysses_all_to_all(s2[0], s2[1], transport=tr)
        assert torch.equal(outs[0], q[:, :, rank * hl:(rank + 1) * hl])
        assert torch.equal(outs[1], k[:, :, rank * hl:(rank + 1) * hl])

        x = q[:, :, rank * hl:(rank + 1) * hl]
        back = cp_ops.ulysses_all_to_all_inverse(x, transport=tr)
        assert not _aliases(back, pool)
        cp_ops.ulysses_all_to_all_inverse(q2[:, :, rank * hl:(rank + 1) * hl], transport=tr)
        assert torch.equal(back, _shard(q, rank, w))
    assert len(pool.pool) >= 4  # the emulation was really used


def test_public_outputs_never_alias_pooled_buffers():
    run_ranks(_public_outputs_are_owned, 2)


def _compiled_pipelined(rank, w):
    """Pipelined Ulysses with three sub-groups (one head each), compiled by Inductor without the overlap pass on a
    transport with the fast one's pool (2 slots per key; a launch onto a slot not yet waited raises): equal to eager
    on the torch transport, over two calls. Failed before (2026-12-02): Inductor fused the three sub-groups' copies
    out of their inverse buffers into one kernel after the third inverse launch — three in flight ("slot ... still
    holds an output"); with the waits ordered alone, that kernel re-read the first buffer after the third launch had
    taken its slot (wrong values). Now each launch is ordered after what read the slot's previous output (``after``)
    and the copies out are an opaque op. On uneven shards, with two FP8 formats holding one tensor each (q e4m3,
    v e5m2: two uint8 send buffers of one shape per sub-group, so sub-groups 0 and 1 in flight are 4 launches of one
    key: test_fp8's test_slotted_transport_pipelined_mixed_formats, eager). With the overlap pass (cp_ops.compile),
    on the same transport and sub-groups with uneven shards and a key mask: the next test."""
    from pooled_transport import install_slotted

    install_slotted()
    from cp_ops import layout

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    seq = layout.shard_sizes(6 * w + 1, w)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, sum(seq), 3 * w, 8, generator=g) for _ in range(3))
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
    kw = dict(mode="ulysses", chunks=3, seq_lens=seq, comm_dtype={"q": e4, "v": e5})
    with torch.no_grad():
        ref = cp_ops.attention(sh(q), sh(k), sh(v), transport="torch", **kw)
        f = torch.compile(lambda a, b, c: cp_ops.attention(a, b, c, transport="slotted_test", **kw), fullgraph=True)
        assert torch.equal(f(sh(q), sh(k), sh(v)), ref)
        again = cp_ops.attention(sh(q + 1), sh(k), sh(v), transport="torch", **kw)
        assert torch.equal(f(sh(q + 1), sh(k), sh(v)), again)


def test_compiled_pipelined_ulysses_keeps_pool_slots():
    run_ranks(_compiled_pipelined, 2)


def _compiled_pipelined_uneven_masked(rank, w):
    """cp_ops.compile of pipelined Ulysses on uneven shards with a key mask of this rank's keys (3 sub-groups of 2
    heads; rank 0 holds 5 tokens, rank 1 3: only rank 1 pads, so the two ranks' graphs differ) = eager, bitwise, over
    two calls (the second launches onto the slots the first one's outputs took: the previous test's bug, here with
    the overlap pass moving the launches).
    Failed before (2026-12-02): the overlap pass moved launches by each graph's dependencies, so rank 1 sent sub-group
    1's K/V before sub-group 0's Q while rank 0 kept the traced order (gloo aborted rank 0: "Received data size
    doesn't match expected size"). Now a launch is never moved past another collective."""
    from pooled_transport import install_slotted

    install_slotted()
    from cp_ops import layout

    seq = (5, 3)
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, sum(seq), 6 * w, 8, generator=g) for _ in range(3))
    mask = torch.rand(1, sum(seq), generator=g) > 0.3
    mask[:, 0] = True
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
    kw = dict(mode="ulysses", chunks=3, seq_lens=seq, key_mask=sh(mask))
    with torch.no_grad():
        ref = cp_ops.attention(sh(q), sh(k), sh(v), transport="torch", **kw)
        f = cp_ops.compile(lambda a, b, c: cp_ops.attention(a, b, c, transport="slotted_test", **kw), fullgraph=True)
        assert torch.equal(f(sh(q), sh(k), sh(v)), ref)
        again = cp_ops.attention(sh(q + 1), sh(k), sh(v), transport="torch", **kw)
        assert torch.equal(f(sh(q + 1), sh(k), sh(v)), again)


def test_compiled_pipelined_ulysses_uneven_masked_keeps_collective_order():
    run_ranks(_compiled_pipelined_uneven_masked, 2)
