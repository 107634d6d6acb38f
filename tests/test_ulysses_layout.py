"""cp_ops.layout's Ulysses packing as the eager path uses it: one-call pack, all-slots unpack (CPU, no group)."""

import itertools

import pytest
import torch

from cp_ops import layout


def _pack_reference(xs, w):
    """The send buffer by its definition: slab t, slot i = head group t of xs[i] (one copy per tensor)."""
    b, s, h, d = xs[0].shape
    hl = h // w
    buf = torch.full((w, b, s, len(xs), hl, d), float("nan"), dtype=xs[0].dtype)
    for i, x in enumerate(xs):
        for t in range(w):
            buf[t, :, :, i] = x[:, :, t * hl:(t + 1) * hl]
    return buf


@pytest.mark.parametrize("w,b,s,n,dtype", [(2, 1, 5, 3, torch.float32), (3, 2, 4, 3, torch.bfloat16),
                                           (4, 3, 1, 2, torch.float32), (2, 2, 3, 1, torch.float16)])
def test_pack_equals_definition_for_any_strides(w, b, s, n, dtype):
    h, d = 4 * w, 6
    g = torch.Generator().manual_seed(w * 100 + b * 10 + n)
    xs = [torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(n)]
    # a transposed copy and a slice with a storage offset: same values, other strides
    odd = [xs[0].transpose(1, 2).contiguous().transpose(1, 2), torch.randn(b, s, h, d + 2, generator=g).to(dtype)[..., 1:-1]]
    odd[1].copy_(xs[-1])
    for ins in (xs, odd[:1] + xs[1:], xs[:-1] + odd[1:]):
        out = layout.ulysses_pack(ins, w)
        assert out.is_contiguous() and out.shape == (w, b, s, n, h // w, d)
        assert torch.equal(out, _pack_reference(xs, w))


@pytest.mark.parametrize("w,b,s,hl,d,n,dtype", [
    (2, 1, 5, 2, 8, 3, torch.bfloat16), (3, 1, 4, 1, 5, 2, torch.float32),  # B = 1: views
    (2, 2, 8, 2, 16, 3, torch.float32),  # B > 1, slices 256-byte aligned: one copy of every slot
    (2, 2, 3, 1, 5, 3, torch.bfloat16),  # B > 1, not aligned: one copy per slot
])
def test_unpack_all_equals_each_slot_with_its_strides(w, b, s, hl, d, n, dtype):
    g = torch.Generator().manual_seed(s * 7 + d)
    buf = torch.randn(w, b, s, n, hl, d, generator=g).to(dtype)
    outs = layout.ulysses_unpack_all(buf)
    assert len(outs) == n
    aligned = (b * w * s * hl * d * buf.element_size()) % 256 == 0
    for i, o in enumerate(outs):
        want = layout.ulysses_unpack(buf, i)
        assert o.shape == want.shape == (b, w * s, hl, d)
        assert o.stride() == want.stride() and torch.equal(o, want)
        shares = o.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert shares == (b == 1)  # B = 1 reads the buffer in place; B > 1 copies
        if b > 1 and i > 0:  # one allocation for every slot exactly when aligned
            assert (o.data_ptr() - outs[0].data_ptr() == i * o.numel() * o.element_size()) == aligned
