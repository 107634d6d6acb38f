"""layout='bhsd' (SDPA's [B, H, S, D]) in and out of cp_ops.attention and the collectives, equal to the BSHD call;
a BHSD tensor passed without layout= is a clear error naming both layouts (issue 22 item 1). CPU gloo, W = 2."""

import pytest
import torch

import cp_ops
from dist_util import run_ranks


def _bhsd(rank, w):
    g = torch.Generator().manual_seed(21)
    b, s, h, d = 2, 12 * w, 4, 8
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    sl = slice(rank * 12, (rank + 1) * 12)
    ql, kl, vl = (t[:, sl] for t in (q, k, v))
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    for mode in ("agkv", "ulysses"):
        for chunks in (1, 2):
            ref = cp_ops.attention(ql, kl, vl, mode=mode, chunks=chunks)
            out = cp_ops.attention(t(ql), t(kl), t(vl), mode=mode, chunks=chunks, layout="bhsd")
            assert out.shape == (b, h, 12, d)
            assert torch.equal(t(out), ref), (mode, chunks)
    # the BSHD call equals one device bitwise (chunks 1), so the BHSD one does too
    assert torch.equal(t(cp_ops.attention(t(ql), t(kl), t(vl), mode="agkv", chunks=1, layout="bhsd")),
                       cp_ops.local_attention(q, k, v)[:, sl])
    kf, vf = cp_ops.agkv_gather(t(kl), t(vl), layout="bhsd")
    assert torch.equal(kf, t(k)) and torch.equal(vf, t(v))
    qh, kh = cp_ops.ulysses_all_to_all(t(ql), t(kl), layout="bhsd")
    heads = slice(rank * h // w, (rank + 1) * h // w)
    assert torch.equal(qh, t(q[:, :, heads])) and torch.equal(kh, t(k[:, :, heads]))
    back = cp_ops.ulysses_all_to_all_inverse(qh, layout="bhsd")
    assert torch.equal(back, t(ql))


def test_bhsd_equals_bshd():
    run_ranks(_bhsd, 2)


def _misuse(rank, w):
    x = torch.randn(1, 8, 512, 64)  # [B, H, S, D] per rank, passed without layout=
    with pytest.raises(ValueError, match=r"q has shape \[1, 8, 512, 64\].*512 heads and 8 tokens.*layout='bhsd'"):
        cp_ops.attention(x, x, x)
    with pytest.raises(ValueError, match=r"tensor 0 has shape \[1, 8, 512, 64\].*layout='bhsd'"):
        cp_ops.agkv_gather(x, x)
    with pytest.raises(ValueError, match=r"layout must be 'bshd' \(\[B, S, H, D\]\) or 'bhsd'.*got 'sbhd'"):
        cp_ops.attention(x, x, x, layout="sbhd")
    out = cp_ops.attention(x, x, x, layout="bhsd", mode="agkv")  # the group is fine afterwards
    assert out.shape == x.shape


def test_bhsd_passed_as_bshd_is_an_error_naming_both_layouts():
    run_ranks(_misuse, 2)
