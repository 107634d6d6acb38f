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


@pytest.mark.parametrize("w,hl,lo,hi", [(2, 4, 0, 2), (2, 4, 2, 4), (3, 3, 1, 2), (4, 2, 0, 2)])
def test_pack_of_a_head_range_equals_packing_those_heads(w, hl, lo, hi):
    """pipelined Ulysses' sub-group: heads [lo, hi) of every head group, packed without the intermediate copy."""
    b, s, d = 2, 3, 5
    g = torch.Generator().manual_seed(w * 10 + lo)
    xs = [torch.randn(b, s, w * hl, d, generator=g) for _ in range(3)]
    sub = [x.view(b, s, w, hl, d)[:, :, :, lo:hi].reshape(b, s, w * (hi - lo), d) for x in xs]
    out = layout.ulysses_pack(xs, w, lo, hi)
    assert out.is_contiguous() and torch.equal(out, _pack_reference(sub, w))


class _NoHeadRange:
    """The torch transport without ``ulysses_start_heads``: pipelined Ulysses copies each sub-group first."""

    def __init__(self, inner):
        self.inner = inner

    def ulysses_start(self, xs, group):
        return self.inner.ulysses_start(xs, group)

    def ulysses_inverse_start(self, x, group):
        return self.inner.ulysses_inverse_start(x, group)


def _eager_equals_ops(rank, w):
    """The one Ulysses body: with the direct comm (eager: one pack, all slots unpacked at once) and with the op comm
    (traced: torch.library launches, per-slot unpack) the same bits, chunks 1, 2, 3; and with a transport without
    ulysses_start_heads (each sub-group's heads copied first)."""
    import torch.distributed as dist
    from cp_ops.comm import DirectComm, OpComm
    from cp_ops.modes.ulysses import ulysses
    from cp_ops.transport import base

    pg, tr = dist.group.WORLD, base.get("torch")
    name = pg.group_name
    for b in (1, 2):
        g = torch.Generator().manual_seed(10 * b + rank)
        q, k, v = (torch.randn(b, 6, 3 * w, 8, generator=g) for _ in range(3))
        for chunks in (1, 2, 3):
            ops = ulysses(q, k, v, OpComm(w, name, "torch", "", 0, rank), scale=0.3, chunks=chunks)
            direct = ulysses(q, k, v, DirectComm(pg, tr), scale=0.3, chunks=chunks)  # packs from q, k, v
            copied = ulysses(q, k, v, DirectComm(pg, _NoHeadRange(tr)), scale=0.3, chunks=chunks)
            assert torch.equal(direct, ops) and torch.equal(copied, ops), (b, chunks)


def test_eager_ulysses_bitwise_equals_the_ops():
    from dist_util import run_ranks

    run_ranks(_eager_equals_ops, 2)


@pytest.mark.parametrize("dtype,d,wide", [(torch.bfloat16, 128, torch.int64), (torch.float32, 6, torch.int64),
                                          (torch.bfloat16, 6, torch.int32), (torch.uint8, 132, torch.int32),
                                          (torch.float16, 7, torch.float16)])
def test_layout_copies_move_rows_as_wide_integers_bitwise(dtype, d, wide):
    """The eager layout copies (pack, inverse pack, inverse unpack) move each row as the widest integer dtype it allows
    (layout.wide: 4x fewer elements for bf16 rows of 128) and keep every bit: random bit patterns, NaN payloads
    among them, come through equal as raw bytes; a row that allows no wider dtype keeps its own."""
    w, b, s, h = 2, 2, 3, 4
    g = torch.Generator().manual_seed(d)
    bits = torch.randint(0, 256, (3, b, s, h, d * torch.empty(0, dtype=dtype).element_size()), generator=g,
                         dtype=torch.uint8)
    xs = list(bits.view(dtype).unbind(0))
    assert layout.wide(xs[0]).dtype == wide
    raw = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731 - compare bytes, not values (NaN != NaN)
    want = torch.empty(w, b, s, 3, h // w, d, dtype=dtype)  # the definition, as _pack_reference (any dtype)
    for i, t in enumerate(xs):
        for r in range(w):
            want[r, :, :, i] = t[:, :, r * (h // w):(r + 1) * (h // w)]
    assert torch.equal(raw(layout.ulysses_pack(xs, w)), raw(want))
    x6 = torch.cat([xs[0], xs[1]], dim=1)  # [B, 6, H, D]: 6 tokens over W = 2 (H as the heads Hl it holds)
    inv = layout.ulysses_inverse_pack(x6, w)
    assert inv.dtype == dtype and torch.equal(raw(inv), raw(x6.reshape(b, w, 3, h, d).transpose(0, 1)))
    buf = bits[:w].view(dtype).reshape(w, b, s, h, d)
    un = layout.ulysses_inverse_unpack(buf)
    assert un.dtype == dtype and torch.equal(raw(un), raw(buf.permute(1, 2, 0, 3, 4).reshape(b, s, w * h, d)))


def test_wide_keeps_a_tensor_that_requires_grad():
    """An integer view has no grad_fn: a tensor that requires grad keeps its dtype (cp_ops' backward error, which
    tests/test_grad.py checks through the public collectives, must still be reached through the copies)."""
    x = torch.randn(1, 4, 2, 8, requires_grad=True)
    assert layout.wide(x) is x and layout.wide(x.detach()).dtype == torch.int64
    assert layout.ulysses_inverse_unpack(x.view(2, 1, 2, 2, 8)).grad_fn is not None
