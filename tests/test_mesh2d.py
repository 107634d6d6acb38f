"""2-D CP (cp_ops.attention on a ('agkv', 'ulysses') DeviceMesh) on real gloo ranks: equal to one device (bitwise at
chunks 1 where the same SDPA calls see the same data; ≤ 1e-5 pipelined), even and uneven shards, key masks, fp32/bf16;
degenerate meshes equal the 1-D modes; torch.compile(fullgraph=True) equal to eager; the rules raise on every rank."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cp_ops
from cp_ops import layout
from cp_ops.kernels import local_attention as masked_attention
from dist_util import run_ranks


def _mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("agkv", "ulysses"))


def _data(b, total, h, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, total, h, d, generator=g).to(dtype) for _ in range(3))
    mask = torch.rand(b, total, generator=g) > 0.35
    mask[:, 0] = True
    return q, k, v, mask


def _ref(q, k, v, mask, shape, rank, seq, scale=None):
    """One device, with the SDPA calls the 2-D layout makes: per head group g of the inner size, the queries of this
    rank's row against every key; this rank's rows of the result. With a mask on rows of unequal sizes the keys are
    the rows padded to the largest (zeros, masked), as the outer AGKV attends them (cp_ops.layout.Shards)."""
    o_n, i_n = shape
    o = rank // i_n
    offs = layout.shard_offsets(seq)
    lo = offs[o * i_n]
    hi = lo + sum(seq[o * i_n:(o + 1) * i_n])
    hl = q.shape[2] // i_n
    rows = [sum(seq[r * i_n:(r + 1) * i_n]) for r in range(o_n)]
    if mask is not None and len(set(rows)) > 1:
        from test_uneven import _padded

        k, v, mask = (_padded(t, rows) for t in (k, v, mask))
    row = torch.cat([masked_attention(q[:, lo:hi, g * hl:(g + 1) * hl], k[:, :, g * hl:(g + 1) * hl],
                                      v[:, :, g * hl:(g + 1) * hl], scale, mask) for g in range(i_n)], dim=2)
    return row[:, offs[rank] - lo: offs[rank] - lo + seq[rank]]


# (B, H, D, split): split = a total token count (layout.shard_sizes) or explicit seq_lens
CASES = {
    (2, 2): [(1, 4, 8, 16), (2, 6, 8, 13), (1, 2, 16, (5, 0, 7, 3))],
    (3, 2): [(1, 4, 8, 24), (1, 2, 8, (4, 1, 0, 6, 2, 2))],
    (2, 4): [(1, 4, 8, 32), (2, 8, 8, (3, 1, 4, 1, 5, 9, 2, 6))],
    (4, 2): [(1, 2, 8, 32), (1, 6, 8, 21)],
}


def _equal_to_one_device(rank, w, shape):
    mesh = _mesh(shape)
    for n, (b, h, d, split) in enumerate(CASES[shape]):
        seq = layout.shard_sizes(split, w) if isinstance(split, int) else split
        even = len(set(seq)) == 1
        q, k, v, mask = _data(b, sum(seq), h, d, seed=1000 * w + 10 * shape[0] + n)
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
        for m in (None, mask):
            kw = dict(seq_lens=None if even else seq, key_mask=None if m is None else sh(m))
            out = cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, chunks=1, **kw)
            same = _ref(q, k, v, m, shape, rank, seq)
            assert out.shape == same.shape and out.is_contiguous()
            assert torch.equal(out, same), (shape, seq, m is not None, (out - same).abs().max().item())
            full = sh(masked_attention(q, k, v, None, m))
            torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
            if m is None:  # pipelined outer AGKV (LSE merge: not bitwise)
                for chunks in (2, 3):
                    out = cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, mode="agkv_ulysses", chunks=chunks, **kw)
                    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    # bf16, a custom scale, a repeat call (the eager plan) with fresh data
    for seed in (1, 2):
        q, k, v, _ = _data(2, 4 * w, 4, 8, seed=seed, dtype=torch.bfloat16)
        sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
        out = cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, scale=0.3)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, _ref(q, k, v, None, shape, rank, (4,) * w, 0.3))


@pytest.mark.parametrize("shape", [(2, 2), (3, 2), (2, 4), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_2d_equals_one_device(shape):
    run_ranks(_equal_to_one_device, shape[0] * shape[1], shape)


def _degenerate(rank, w):
    q, k, v, mask = _data(1, 3 * w, 4, 8, seed=5)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    for shape, mode in (((1, w), "ulysses"), ((w, 1), "agkv")):
        mesh = _mesh(shape)
        for m in (None, mask):
            km = None if m is None else sh(m)
            got = cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, key_mask=km)
            one_d = cp_ops.attention(sh(q), sh(k), sh(v), group=dist.group.WORLD, mode=mode, chunks=1, key_mask=km)
            assert torch.equal(got, one_d), (shape, mode)
            assert torch.equal(got, _ref(q, k, v, m, shape, rank, (3,) * w))


def test_degenerate_meshes_equal_1d_modes():
    run_ranks(_degenerate, 4)


def _compiled(rank, w):
    """Compiled 2-D calls = eager. The variants (key masks, pipelined, uneven shards, a degenerate mesh) through Dynamo
    + AOTAutograd (aot_eager: the 2-D body traced, the ops' fake kernels, functionalization); Inductor with and
    without the overlap pass on a block (the 2-D body's launches are the 1-D ops, whose Inductor lowerings the 1-D
    compiled tests check with masks, uneven shards and pipelined AGKV: test_uneven.test_compiled_equals_eager)."""
    mesh = _mesh((2, 2))
    aot = dict(fullgraph=True, backend="aot_eager")
    # even shards with a key mask (two inputs, one graph). Traced elsewhere, one compile each: the 2-D body without
    # a mask by Inductor below (and with FP8 codecs, chunks 1 and 2, bitwise: test_fp8_mesh), pipelined on uneven
    # shards below
    f = torch.compile(lambda q, k, v, m: cp_ops.attention(q, k, v, group=mesh, key_mask=m), **aot)
    for seed in (11, 12):
        q, k, v, mask = _data(1, 16, 4, 8, seed=seed)
        sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
        eager = cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, key_mask=sh(mask))
        assert torch.equal(f(sh(q), sh(k), sh(v), sh(mask)), eager)
    # uneven shards, with a mask (chunks 1) and pipelined (chunks 2: the outer AGKV inside one op)
    seq = (5, 2, 0, 6)
    u = torch.compile(lambda q, k, v, m, c: cp_ops.attention(q, k, v, group=mesh, seq_lens=seq, key_mask=m, chunks=c),
                      **aot)
    q, k, v, mask = _data(1, sum(seq), 4, 8, seed=15)
    sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
    assert torch.equal(u(sh(q), sh(k), sh(v), sh(mask), 1), _ref(q, k, v, mask, (2, 2), rank, seq))
    torch.testing.assert_close(u(sh(q), sh(k), sh(v), None, 2), sh(cp_ops.local_attention(q, k, v)),
                               rtol=1e-5, atol=1e-5)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    # with the overlap pass (cp_ops.compile): a block whose K/V launches can move above the Q projection
    wq = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))
    block = lambda q, k, v: cp_ops.attention(q @ wq, k, v, group=mesh)  # noqa: E731
    p = cp_ops.compile(block, fullgraph=True)
    q, k, v, _ = _data(1, 16, 4, 8, seed=14)
    got = p(sh(q), sh(k), sh(v))
    # the pass moves the launches and changes nothing else: bitwise = the same block compiled without it; eager's
    # matmul may round the projection differently from Inductor's (tests/row_exact.py): equal to rounding
    torch._dynamo.reset()
    assert torch.equal(got, torch.compile(block, fullgraph=True)(sh(q), sh(k), sh(v)))
    torch.testing.assert_close(got, block(sh(q), sh(k), sh(v)), rtol=1e-6, atol=1e-6)
    # a degenerate mesh compiled: the 1-D call on its one dim
    flat = _mesh((1, 4))
    h = torch.compile(lambda q, k, v: cp_ops.attention(q, k, v, group=flat), **aot)
    q, k, v, _ = _data(1, 16, 4, 8, seed=13)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    assert torch.equal(h(sh(q), sh(k), sh(v)), cp_ops.attention(sh(q), sh(k), sh(v), group=flat))


def test_2d_compiled_equals_eager():
    run_ranks(_compiled, 4)


def _rules(rank, w):
    mesh = _mesh((2, 4))
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match=r"heads=6, inner size=4 \(mesh 2x4\)"):
        cp_ops.attention(q, q, q, group=mesh)
    # a 1xW mesh (1-D Ulysses over its inner dim): the mesh's rule and values (was: the 1-D message, advising
    # mode='agkv', which a mesh refuses)
    with pytest.raises(ValueError, match=r"heads=6, inner size=8 \(mesh 1x8\)"):
        cp_ops.attention(q, q, q, group=_mesh((1, w)))
    with pytest.raises(ValueError, match=r"2-D CP mesh .* must be one of \('auto', 'agkv_ulysses'\); got 'ulysses'"):
        cp_ops.attention(q, q, q, group=mesh, mode="ulysses")
    q = torch.randn(1, 4, 8, 8)
    with pytest.raises(ValueError, match="mode='agkv_ulysses' runs on a 2-D DeviceMesh"):
        cp_ops.attention(q, q, q, mode="agkv_ulysses")
    bad = init_device_mesh("cpu", (2, 4), mesh_dim_names=("ulysses", "agkv"))
    with pytest.raises(ValueError, match=r"mesh_dim_names=\('agkv', 'ulysses'\)"):
        cp_ops.attention(q, q, q, group=bad)
    # one rank's bad input (a key mask of the wrong shape on rank 5 only): every rank raises, none waits
    m = torch.ones(1, 4 if rank != 5 else 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="key_mask must be"):
        cp_ops.attention(q, q, q, group=mesh, key_mask=m)
    # every key's mask ([B, S_total]) on a 2-D mesh: the rule named (was: only "must be [B, S_local]")
    with pytest.raises(ValueError, match=r"every key \(\[B, S_total\] = \[1, 32\]\) is not supported on a 2-D CP mesh"):
        cp_ops.attention(q, q, q, group=mesh, key_mask=torch.ones(1, 4 * w, dtype=torch.bool))
    # the ranks disagree on the call (rank 0 names another layer): every rank raises, in both dims
    with pytest.raises(ValueError):
        cp_ops.attention(q, q, q, group=mesh, tag="layer0" if rank else "layer1")
    # the group still works after
    q, k, v, _ = _data(1, 4 * w, 8, 8, seed=3)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    assert torch.equal(cp_ops.attention(sh(q), sh(k), sh(v), group=mesh), _ref(q, k, v, None, (2, 4), rank, (4,) * w))


def test_2d_rules_raise_on_every_rank():
    run_ranks(_rules, 8)


def _one_rank_rejects(rank, w):
    """A check that fails on one rank only, raised on every rank and the mesh in step after: comm_dtype on one rank
    of a mesh (when a mesh refused comm_dtype, that was raised before any exchange: the other ranks ran the call
    without rank 0 and every later call paired wrong; now a variant the other ranks do not share) and a bad key mask
    on a degenerate mesh (its 1-D call's group was not told); cp_ops.describe takes a mesh and comm_dtype (was:
    ValueError / TypeError)."""
    mesh = _mesh((2, 2))
    q, k, v, _ = _data(1, 4 * w, 4, 8, seed=21)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    with pytest.raises(ValueError, match=r"rank\(s\) \[0\]|differ in"):
        cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, comm_dtype=torch.float8_e4m3fn if rank == 0 else None)
    assert torch.equal(cp_ops.attention(sh(q), sh(k), sh(v), group=mesh), _ref(q, k, v, None, (2, 2), rank, (4,) * w))
    flat = _mesh((1, 4))
    m = torch.ones(1, 4 if rank != 1 else 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"key_mask must be|rank\(s\) \[1\]"):
        cp_ops.attention(sh(q), sh(k), sh(v), group=flat, key_mask=m)
    assert torch.equal(cp_ops.attention(sh(q), sh(k), sh(v), group=flat), _ref(q, k, v, None, (1, 4), rank, (4,) * w))
    c = cp_ops.describe(sh(q), sh(k), sh(v), group=mesh)
    assert (c.mode, c.chunks, c.source, c.transport) == ("agkv_ulysses", 1, "heuristic", "torch"), c
    c = cp_ops.describe(sh(q), group=mesh, mode="agkv_ulysses", chunks=2)
    assert (c.mode, c.chunks, c.source) == ("agkv_ulysses", 2, "explicit"), c
    c = cp_ops.describe(sh(q), group=flat)  # the rule that chose the mode (was: "mode 'ulysses' given")
    assert c.mode == "ulysses" and "a 1x4 mesh: 1-D ulysses over its 'ulysses' dim" in c.why, c.why
    assert "given" not in c.why, c.why
    with pytest.raises(ValueError, match=r"heads=4, inner size=4|inner size"):
        cp_ops.describe(sh(q)[:, :, :3], group=mesh)
    assert cp_ops.describe(sh(q), group=mesh, comm_dtype=torch.float8_e4m3fn).mode == "agkv_ulysses"
    with pytest.raises(ValueError, match="gathers K and V together over the outer"):
        cp_ops.describe(sh(q), group=mesh, comm_dtype={"k": torch.float8_e4m3fn})
    # a 1-D call with comm_dtype can be copied into describe as is; a bad comm_dtype raises as the call would
    assert cp_ops.describe(sh(q), sh(k), sh(v), comm_dtype=torch.float8_e4m3fn).mode == "ulysses"
    with pytest.raises(ValueError, match="comm_dtype"):
        cp_ops.describe(sh(q), comm_dtype={"x": torch.float8_e4m3fn})
    with pytest.raises(ValueError, match="gathers K and V together"):
        cp_ops.describe(sh(q), mode="agkv", comm_dtype={"k": torch.float8_e4m3fn})


def test_one_rank_rejects_and_describe_on_a_mesh():
    run_ranks(_one_rank_rejects, 4)


def _compiled_row_fails(rank, w):
    """Compiled 2-D calls whose row (ranks 2, 3) disagrees (rank 2 names another tag): every rank raises, and the
    mesh stays in step — the failed row tells its columns (its row exchange failed before its column exchange; the
    other rows' column exchange paired with that row's next call: the next call raised on rows that did nothing
    wrong and passed on others, and the mesh fell apart)."""
    mesh = _mesh((2, 2))
    q, k, v, _ = _data(1, 4 * w, 4, 8, seed=51)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    ref = _ref(q, k, v, None, (2, 2), rank, (4,) * w)
    t = "b" if rank == 2 else "a"
    # the rows' checks run inside the ops: AOTAutograd's graph is enough (Inductor: test_2d_compiled_equals_eager)
    f = torch.compile(lambda a, b, c: cp_ops.attention(a, b, c, group=mesh, tag=t), fullgraph=True,
                      backend="aot_eager")
    with pytest.raises(ValueError, match="differ in variant|rejected their inputs"):
        f(sh(q), sh(k), sh(v))
    for _ in range(2):
        assert torch.equal(cp_ops.attention(sh(q), sh(k), sh(v), group=mesh), ref)


def test_compiled_row_failure_keeps_the_mesh_in_step():
    run_ranks(_compiled_row_fails, 4)


def _remade_after_destroy(rank, w, store):
    """A mesh made after destroy_process_group() and a re-init, with the destroyed mesh's layout (a DeviceMesh compares
    equal by layout, and torch reuses the group names): its calls run on its own process groups (was: on the destroyed
    mesh's, through the eager plan cached for the equal mesh — on NCCL, communicators already shut down)."""
    from cp_ops import contract

    q, k, v, _ = _data(1, 4 * w, 4, 8, seed=61)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    ref = _ref(q, k, v, None, (2, 2), rank, (4,) * w)
    for n in range(2):
        mesh, flat = _mesh((2, 2)), init_device_mesh("cpu", (w,), mesh_dim_names=("cp",))
        for _ in range(2):  # the second call: the cached plan
            assert torch.equal(cp_ops.attention(sh(q), sh(k), sh(v), group=mesh), ref)
            assert torch.equal(cp_ops.attention(sh(q), sh(k), sh(v), group=flat, mode="agkv"),
                               sh(masked_attention(q, k, v, None, None)))
        for pg in (mesh.get_group("agkv"), mesh.get_group("ulysses"), flat.get_group()):
            assert contract._groups[pg.group_name].pg is pg, (n, pg.group_name)  # its exchanges ran on this group
        if n == 0:
            dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=w)


def test_a_mesh_remade_after_destroy_runs_on_its_own_groups(tmp_path):
    run_ranks(_remade_after_destroy, 4, str(tmp_path / "store"))
