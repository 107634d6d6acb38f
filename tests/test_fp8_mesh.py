"""FP8 communication (``comm_dtype``) on a 2-D ('agkv', 'ulysses') mesh, on the public collectives and through
``parallelize`` on a mesh; real gloo ranks, W = 4 (a 2x2 mesh; the collectives on the group of 4).

The mesh at chunks = 1: bitwise the SDPA calls the 2-D layout makes (tests/test_mesh2d.py) on the tensors as they
arrive — Q round-tripped through the codec once, K and V twice (the inner all-to-all, then the outer gather), the
output once; within a bound derived from the codec's actual errors and within the stated tolerance (2 x the codec's
relative step x max|output|, docs/fp8.md); pipelined within the bound; the input dtype as comm_dtype bitwise the plain
call; ranks that disagree raise on every rank; compiled = eager. The collectives: bitwise ``round_trip`` of the plain
result, every element within the codec's per-element bound and some element near it (> 75 %)."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cp_ops
from cp_ops import comm_dtype as cd
from cp_ops import layout
from cp_ops.kernels import fp8, local_attention
from dist_util import run_ranks
from test_fp8 import tiny_wan_and_inputs

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
#: half an ulp of the fp8 mantissa (relative, normal fp8 values) and half the smallest subnormal (absolute, in units of
#: the row's scale), per format (tests/test_fp8.py, docs/fp8.md)
REL = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
SUB = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}
BF16 = 2.0 ** -8  # bf16's rounding of the decoded value (half an ulp, relative)


def _mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=("agkv", "ulysses"))


def _data(b, total, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, total, h, d, generator=g).to(torch.bfloat16) for _ in range(3))
    mask = torch.rand(b, total, generator=g) > 0.3
    mask[:, 0] = True
    return q, k, v, mask


def _rt(x, f, trips=1):
    for _ in range(trips if f else 0):
        x = fp8.round_trip(x, f)
    return x


def _same_calls(qr, kr, vr, fo, mask, rank, seq, shape):
    """The mesh's result at chunks = 1 from the tensors as they arrive (``qr``, ``kr``, ``vr``: round-tripped), with
    its SDPA calls: per head group g of the inner dim, this rank's row of queries against every key; then this
    rank's tokens, the output round-tripped (``fo``). With a mask on rows of unequal sizes the keys are the rows
    padded to the largest (zeros, masked), as the outer AGKV attends them (cp_ops.layout.Shards)."""
    from test_uneven import _padded

    i_n = shape[1]
    o = rank // i_n
    offs = layout.shard_offsets(seq)
    lo, hi = offs[o * i_n], offs[o * i_n] + sum(seq[o * i_n:(o + 1) * i_n])
    hl = qr.shape[2] // i_n
    rows = [sum(seq[r * i_n:(r + 1) * i_n]) for r in range(shape[0])]
    if mask is not None and len(set(rows)) > 1:
        kr, vr, mask = (_padded(t, rows) for t in (kr, vr, mask))
    row = torch.cat([local_attention(*(t[:, a:b, g * hl:(g + 1) * hl] for t, a, b in
                                       ((qr, lo, hi), (kr, None, None), (vr, None, None))), None, mask)
                     for g in range(i_n)], dim=2)
    return _rt(row[:, offs[rank] - lo:offs[rank] - lo + seq[rank]], fo)


def _bound(q, k, v, qr, kr, vr, fo, mask, ref):
    """|fp8 output - exact output| ≤ this, from the codec's actual errors (docs/fp8.md): the logits move by at most
    E = max|s' - s|, so every softmax weight by a factor in [e^-2E, e^2E] and the output by at most
    (e^2E - 1)·max|v'|; V's own error adds max|v' - v|; O's round trip its relative step; plus the attention's bf16
    rounding (one ulp of the largest output each, three roundings)."""
    sc = 1 / math.sqrt(q.shape[-1])
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * sc
    s2 = torch.einsum("bqhd,bkhd->bhqk", qr.float(), kr.float()) * sc
    if mask is not None:
        keep = mask[:, None, None, :]
        s, s2 = s.masked_fill(~keep, 0), s2.masked_fill(~keep, 0)
    big_e = (s2 - s).abs().amax().item()
    b = math.expm1(2 * big_e) * vr.float().abs().amax().item() + (vr.float() - v.float()).abs().amax().item()
    top = ref.float().abs().amax().item()
    if fo:
        b += (b + top) * REL[fo]
    return b + 3 * BF16 * 2 * top


# ---- attention on a 2x2 mesh ---------------------------------------------------------------------------------------
CHOICES = [E4, E5, {"k": E4, "v": E4}, {"q": E4, "o": E4}]


def _mesh_cases(rank, w):
    mesh = _mesh((2, 2))
    b, h, d = 1, 4, 16
    worst = 0.0
    for i, (seq, masked) in enumerate((((6,) * w, False), ((5, 4, 4, 4), True), ((0, 3, 4, 5), True))):
        q, k, v, mask = _data(b, sum(seq), h, d, seed=70 + i)
        m = mask if masked else None
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
        kw = dict(group=mesh, seq_lens=None if len(set(seq)) == 1 else seq, key_mask=None if m is None else sh(m))
        ref = sh(local_attention(q, k, v, None, m))  # one device, no FP8
        plain = cp_ops.attention(sh(q), sh(k), sh(v), chunks=1, **kw)
        assert torch.equal(cp_ops.attention(sh(q), sh(k), sh(v), chunks=1, comm_dtype=torch.bfloat16, **kw), plain)
        for c in CHOICES:
            fq, fk, fv, fo = fmts = cd.for_mode(cd.normalize(c, q.dtype), "agkv_ulysses")
            qr, kr, vr = _rt(q, fq), _rt(k, fk, 2), _rt(v, fv, 2)  # K and V cross both dims
            same = _same_calls(qr, kr, vr, fo, m, rank, seq, (2, 2))
            bound = _bound(q, k, v, qr, kr, vr, fo, m, ref) if ref.numel() else 0.0
            for chunks in (1, 2) if m is None else (1,):
                out = cp_ops.attention(sh(q), sh(k), sh(v), chunks=chunks, comm_dtype=c, **kw)
                what = (seq, c, chunks, m is not None)
                assert out.shape == ref.shape and out.dtype == ref.dtype, what
                if chunks == 1:
                    assert torch.equal(out, same), (what, (out.float() - same.float()).abs().max())
                if not out.numel():
                    continue
                err = (out.float() - ref.float()).abs().max().item()
                assert 0 < err <= bound, (what, err, bound)
                coarsest = max(REL[f] for f in fmts if f)
                assert err <= 2 * coarsest * ref.float().abs().max().item(), (what, err)  # the stated tolerance
                worst = max(worst, err / bound)
    assert worst > 0.05, worst  # the bound is not vacuous (measured 0.09-0.15 of it on these data, per rank)
    # the degenerate meshes: the 1-D call on the one dim, comm_dtype passed on (bitwise)
    q, k, v, _ = _data(1, 4 * w, 4, 16, seed=81)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    for shape, mode, c in (((1, w), "ulysses", {"q": E4, "v": E4, "o": E4}), ((w, 1), "agkv", E5)):
        got = cp_ops.attention(sh(q), sh(k), sh(v), group=_mesh(shape), comm_dtype=c)
        assert torch.equal(got, cp_ops.attention(sh(q), sh(k), sh(v), mode=mode, chunks=1, comm_dtype=c)), shape
    assert cp_ops.describe(sh(q), group=mesh, comm_dtype=E4).mode == "agkv_ulysses"


def test_fp8_on_a_2x2_mesh():
    run_ranks(_mesh_cases, 4)


def _mesh_rules_and_compiled(rank, w):
    """Ranks that disagree on comm_dtype raise on every rank (both dims) and the mesh stays in step; K and V apart
    raise on every rank (the outer dim gathers them together); compiled (fullgraph) = eager, chunks 1 and 2 (the outer
    pipelined AGKV inside one op, which carries the format)."""
    mesh = _mesh((2, 2))
    q, k, v, _ = _data(1, 4 * w, 4, 16, seed=91)
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    with pytest.raises(ValueError, match=r"differ in|rank\(s\)"):
        cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, comm_dtype=E4 if rank == 3 else None)
    with pytest.raises(ValueError, match=r"gathers K and V together over the outer \('agkv'\) mesh dim"):
        cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, comm_dtype={"q": E4, "v": E4, "o": E4})
    fmts = cd.normalize(E4)
    same = _same_calls(_rt(q, "e4m3"), _rt(k, "e4m3", 2), _rt(v, "e4m3", 2), "e4m3", None, rank, (4,) * w, (2, 2))
    eager = cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, comm_dtype=E4)
    assert torch.equal(eager, same) and fmts == ("e4m3",) * 4
    # traced through Dynamo + AOTAutograd (aot_eager): the 2-D body with its codecs, the fake kernels. Inductor lowers
    # the same launch ops with FP8 codecs in test_fp8.test_compiled_equals_eager, and the 2-D body with the overlap pass
    # in test_mesh2d.test_2d_compiled_equals_eager
    for chunks in (1, 2):
        f = torch.compile(lambda a, b, c: cp_ops.attention(a, b, c, group=mesh, chunks=chunks, comm_dtype=E4),
                          fullgraph=True, backend="aot_eager")
        e = cp_ops.attention(sh(q), sh(k), sh(v), group=mesh, chunks=chunks, comm_dtype=E4)
        assert torch.equal(f(sh(q), sh(k), sh(v)), e), chunks


def test_fp8_mesh_rules_and_compiled():
    run_ranks(_mesh_rules_and_compiled, 4)


# ---- the collectives on a group of 4 -------------------------------------------------------------------------------
def _near_codec_bound(got, x, fmt):
    """Every element of ``got`` (x after one round trip, bf16) within the codec's per-element bound; the largest
    error at more than 75 % of it (the bound is tight: some element rounds by nearly half an fp8 step; the worst
    ratio an element can reach is ~0.94 for e4m3, ~0.89 for e5m2: half a step just above a power of two)."""
    xf, gf = x.float(), got.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -100) / fp8.FORMATS[fmt][1]
    bound = torch.maximum(xf.abs() * REL[fmt], scale * SUB[fmt]) * (1 + 1e-6) + gf.abs() * BF16
    ratio = ((gf - xf).abs() / bound).max().item()
    assert ratio <= 1, ratio
    assert ratio > 0.75, ratio


def _collective_cases(rank, w):
    g = torch.Generator().manual_seed(5)
    b, s, h, d = 2, 6, 8, 16
    full = [(torch.randn(b, w * s, h, d, generator=g) * torch.rand(1, 1, h, 1, generator=g) * 10).to(torch.bfloat16)
            for _ in range(3)]
    q, k, v = (layout.shard(t, 1, rank, w) for t in full)
    hl = h // w
    heads = lambda t: t[:, :, rank * hl:(rank + 1) * hl]  # noqa: E731
    # agkv_gather: the round trip of the full tensors (per-row scales: whichever rank encodes a row, the same bytes)
    for c in (E4, E5, {"k": E4, "v": E4}):
        f = cd.for_mode(cd.normalize(c), "agkv")[1]
        kf, vf = cp_ops.agkv_gather(k, v, comm_dtype=c)
        assert torch.equal(kf, _rt(full[1], f)) and torch.equal(vf, _rt(full[2], f)), c
        _near_codec_bound(kf, full[1], f)
    kf, vf = cp_ops.agkv_gather(k.transpose(1, 2), v.transpose(1, 2), layout="bhsd", comm_dtype=E4)
    assert torch.equal(kf.transpose(1, 2), _rt(full[1], "e4m3"))
    # ulysses_all_to_all: per tensor by position (q, k, v), one launch per format
    for c in (E4, {"q": E4, "k": E5}, {"v": E5}):
        fmts = cd.normalize(c)
        outs = cp_ops.ulysses_all_to_all(q, k, v, comm_dtype=c)
        for i, (o, x) in enumerate(zip(outs, full)):
            assert torch.equal(o, _rt(heads(x), fmts[i])), (c, i)
    _near_codec_bound(cp_ops.ulysses_all_to_all(q, comm_dtype=E4)[0], heads(full[0]), "e4m3")
    # the inverse: the "o" entry
    x = heads(full[0]).contiguous()
    plain = cp_ops.ulysses_all_to_all_inverse(x)
    assert torch.equal(cp_ops.ulysses_all_to_all_inverse(x, comm_dtype=E4), _rt(plain, "e4m3"))
    assert torch.equal(cp_ops.ulysses_all_to_all_inverse(x, comm_dtype={"q": E4}), plain)  # o not named
    # uneven shards (a rank without tokens)
    seq = (5, 0, 7, 4)
    fu = [t[:, :sum(seq)] for t in full]
    shu = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
    kf, vf = cp_ops.agkv_gather(shu(fu[1]), shu(fu[2]), seq_lens=seq, comm_dtype=E4)
    assert torch.equal(kf, _rt(fu[1], "e4m3")) and torch.equal(vf, _rt(fu[2], "e4m3"))
    outs = cp_ops.ulysses_all_to_all(*(shu(t) for t in fu), seq_lens=seq, comm_dtype={"k": E5})
    assert [torch.equal(o, _rt(heads(t), f)) for o, t, f in zip(outs, fu, ("", "e5m2", ""))] == [True] * 3
    xu = heads(fu[0]).contiguous()
    assert torch.equal(cp_ops.ulysses_all_to_all_inverse(xu, seq_lens=seq, comm_dtype=E4),
                       _rt(cp_ops.ulysses_all_to_all_inverse(xu, seq_lens=seq), "e4m3"))
    # the input dtype: the plain collective, bitwise
    assert all(torch.equal(a, p) for a, p in zip(cp_ops.agkv_gather(k, v, comm_dtype=torch.bfloat16),
                                                 cp_ops.agkv_gather(k, v)))
    # bad values and ranks that disagree: ValueError on every rank, the group in step after
    with pytest.raises(ValueError, match="gathers K and V together"):
        cp_ops.agkv_gather(k, v, comm_dtype={"k": E4} if rank == 2 else None)
    with pytest.raises(ValueError, match="at most 3 tensors"):
        cp_ops.ulysses_all_to_all(q, k, v, q, comm_dtype=E4)
    with pytest.raises(ValueError, match=r"differ in|rank\(s\)"):
        cp_ops.ulysses_all_to_all(q, k, comm_dtype=E4 if rank == 0 else None)
    with pytest.raises(ValueError, match=r"differ in|rank\(s\)"):
        cp_ops.agkv_gather(k, v, comm_dtype=E4 if rank == 1 else E5)
    kf, _ = cp_ops.agkv_gather(k, v, comm_dtype=E4)
    assert torch.equal(kf, _rt(full[1], "e4m3"))


def test_fp8_collectives():
    run_ranks(_collective_cases, 4)


# ---- parallelize on a mesh -----------------------------------------------------------------------------------------
def _parallelize_on_mesh(rank, w):
    """parallelize(group=2x2 mesh, comm_dtype=e4m3) runs (it raised at the first forward) and moves the output of the
    one-device model by less than the codec allows through two blocks; K and V apart is refused at parallelize."""
    import copy

    from cp_ops.integrations.diffusers import parallelize

    model, (x, t, text) = tiny_wan_and_inputs()
    mesh = _mesh((2, 2))
    with pytest.raises(ValueError, match=r"parallelize on a 2x2 mesh: comm_dtype: mode='agkv_ulysses' gathers K and V"):
        parallelize(copy.deepcopy(model), mesh, mode="auto", comm_dtype={"q": E4, "v": E4, "o": E4})
    with pytest.raises(ValueError, match=r"parallelize on mode='agkv': comm_dtype: mode='agkv' gathers K and V"):
        parallelize(copy.deepcopy(model), mode="agkv", comm_dtype={"k": E4})
    with torch.no_grad():
        ref = model(x, t, text).sample
        out = parallelize(copy.deepcopy(model), mesh, transport="torch", comm_dtype=E4)(x, t, text).sample
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert 0 < err < 5e-3, err  # as the 1-D test (tests/test_fp8.py): two blocks dilute the attention's error
        same = parallelize(copy.deepcopy(model), mesh, transport="torch", comm_dtype=torch.float32)(x, t, text).sample
        plain = parallelize(copy.deepcopy(model), mesh, transport="torch")(x, t, text).sample
        assert torch.equal(same, plain)


def test_parallelize_on_a_mesh_with_comm_dtype():
    run_ranks(_parallelize_on_mesh, 4)



def _one_by_one(rank, w):
    """A 1x1 mesh with CP_OPS_EMULATE_COMM=1: what a larger mesh computes at chunks 1 (Q and O round-tripped once, K
    and V twice); without the setting, local attention."""
    from cp_ops import config

    mesh = _mesh((1, 1))
    q, k, v, _ = _data(1, 12, 4, 16, seed=95)
    assert torch.equal(cp_ops.attention(q, k, v, group=mesh, comm_dtype=E4), local_attention(q, k, v))
    config.configure(emulate_comm=True)
    try:
        out = cp_ops.attention(q, k, v, group=mesh, comm_dtype=E4)
        f = "e4m3"
        assert torch.equal(out, _same_calls(_rt(q, f), _rt(k, f, 2), _rt(v, f, 2), f, None, 0, (12,), (1, 1)))
    finally:
        config.configure(emulate_comm=False)


def test_one_by_one_mesh_emulates():
    run_ranks(_one_by_one, 1)


def test_a_second_round_trip_changes_nothing():
    """Why K and V crossing both dims of a mesh cost no more than one trip (docs/fp8.md): a decoded bf16 row encodes
    to the same bytes again — its largest element decodes to exactly ±448·scale, which rounds back to amax in bf16
    (amax is a bf16 value), so the scale is the same, and every other value is an fp8 value times the scale rounded
    to bf16 (relative 2^-9), which rounds back to that fp8 value (its steps are 2^-4 relative and wider)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4096, 64, generator=g) * torch.exp(torch.randn(4096, 1, generator=g) * 4)).to(torch.bfloat16)
    x[0] = 0
    for f in fp8.FORMATS:
        once = fp8.round_trip(x, f)
        assert torch.equal(fp8.encode(once, f), fp8.encode(x, f)), f
        assert not torch.equal(once, x)
