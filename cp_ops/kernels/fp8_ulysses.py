"""The FP8 codec (:mod:`cp_ops.kernels.fp8`) fused with the Ulysses layouts (:mod:`cp_ops.layout`): one pass each way
instead of four (encode, pack, decode, unpack); details and speed: docs/fp8.md ("Fused with the Ulysses layouts").

* :func:`pack_encode`: n tensors ``[B, S, H, D]`` → the uint8 send buffer ``[W, B, S, n, hi - lo, D + 4]``;
* :func:`unpack_decode`: the receive buffer ``[W, B, S, n, Hl, D + 4]`` → ``[n, B, W*S, Hl, D]`` (or into ``out``);
* :func:`inverse_decode`: the inverse's receive buffer ``[W, B, S, Hl, D + 4]`` → ``[B, S, W, Hl, D]`` (or ``out``).

Every byte equals the unfused torch version's, which runs where :func:`cp_ops.kernels.fp8.use_triton` is false. One
compiled variant per (input dtype, format, D, HL, pointer alignment) (``do_not_specialize``); each variant's first
call outside a CUDA graph capture runs both versions and compares them (:func:`_first_use`): one that differs or
raises runs the torch version from then on (logged), as does an unchecked one inside a capture.
"""

from __future__ import annotations

import torch

from .. import layout
from . import fp8
from .fp8 import SCALE_BYTES, triton

if triton is not None:
    import triton.language as tl

    from .fp8 import _dequantize, _load_scales, _quantize, _store_scales

    @triton.jit(do_not_specialize=["T", "N", "x_j", "x_b", "x_t", "x_h", "o_j", "o_i", "o_b", "o_t"])
    def _pack_encode_kernel(X0, X1, X2, OUT, T, N, x_j, x_b, x_t, x_h, o_j, o_i, o_b, o_t, HL: tl.constexpr,
                            D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, FMAX: tl.constexpr,
                            E4M3: tl.constexpr):
        """Program (tile, j*N + i, b): rows ``[tile*BLOCK_R, +BLOCK_R)`` of the T*HL (token, head) rows of head group
        j, batch b, of input i (X0..X2: same strides, in D-value rows: x_j per head group, x_b, x_t, x_h) → their
        encoded rows in OUT (strides in (D+4)-byte rows: o_j, o_i per slot, o_b, o_t; heads adjacent)."""
        jn = tl.program_id(1)
        j = (jn // N).to(tl.int64)
        i = jn % N
        b = tl.program_id(2).to(tl.int64)
        src = X0
        if i == 1:
            src = X1
        if i == 2:
            src = X2
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < T * HL
        t = (r // HL).to(tl.int64)
        h = r % HL
        cols = tl.arange(0, BLOCK_D)
        m = rm[:, None] & (cols[None, :] < D)
        x_row = j * x_j + b * x_b + t * x_t + h * x_h
        x = tl.load(src + x_row[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        q, scale = _quantize(x, FMAX, E4M3)
        row_out = OUT + (j * o_j + i.to(tl.int64) * o_i + b * o_b + t * o_t + h) * (D + 4)
        tl.store(row_out[:, None] + cols[None, :], q, mask=m)
        _store_scales(row_out, scale, rm, D)

    @triton.jit(do_not_specialize=["T", "M", "s_j", "s_i", "s_b", "s_t", "o_j", "o_i", "o_b", "o_t", "o_h"])
    def _unpack_decode_kernel(BUF, OUT, T, M, s_j, s_i, s_b, s_t, o_j, o_i, o_b, o_t, o_h, HL: tl.constexpr,
                              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, E4M3: tl.constexpr,
                              OUT_BF16: tl.constexpr):
        """Program (tile, j*M + i, b): rows ``[tile*BLOCK_R, +BLOCK_R)`` of the T*HL (token, head) rows of source j,
        slot i, batch b: BUF's encoded rows (strides in (D+4)-byte rows: s_j, s_i, s_b, s_t; heads adjacent) → OUT's
        decoded rows (strides in D-value rows: o_j, o_i, o_b, o_t, o_h)."""
        jm = tl.program_id(1)
        j = (jm // M).to(tl.int64)
        i = (jm % M).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < T * HL
        t = (r // HL).to(tl.int64)
        h = r % HL
        cols = tl.arange(0, BLOCK_D)
        m = rm[:, None] & (cols[None, :] < D)
        row_in = BUF + (j * s_j + i * s_i + b * s_b + t * s_t + h) * (D + 4)
        q = tl.load(row_in[:, None] + cols[None, :], mask=m, other=0)
        y = _dequantize(q, _load_scales(row_in, rm, D), E4M3, OUT_BF16)
        o_row = j * o_j + i * o_i + b * o_b + t * o_t + h * o_h
        tl.store(OUT + o_row[:, None] * D + cols[None, :], y.to(OUT.dtype.element_ty), mask=m)


# ---- shapes and checks (shared by the Triton and torch versions, and the ops' fake kernels) -----------------------
def packed_shape(shape, world: int, lo: int, hi: int | None, n: int) -> tuple[int, ...]:
    """The send buffer's shape for n inputs of ``shape`` ``[B, S, H, D]``: ``[W, B, S, n, hi - lo, D + 4]``."""
    b, s, h, d = shape
    hi = h // world if hi is None else hi
    return (world, b, s, n, hi - lo, d + SCALE_BYTES)


def check_pack(xs, world: int, lo: int, hi: int | None, fmt: str) -> None:
    """The rules of :func:`pack_encode` (ValueError naming the rule and the values seen)."""
    fp8.format_name(fmt)
    if not xs or len(xs) > 3:
        raise ValueError(f"fp8 ulysses pack takes 1 to 3 tensors (q, k, v); got {len(xs)}")
    x0 = xs[0]
    for x in xs:
        if x.dim() != 4 or x.shape != x0.shape or x.dtype != x0.dtype or x.device != x0.device:
            raise ValueError(f"fp8 ulysses pack takes tensors [B, S, H, D] of one shape, dtype and device; got "
                             f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in xs]}")
    fp8._check_encode(x0, fmt)
    h = x0.shape[2]
    if world < 1 or h % world:
        raise ValueError(f"fp8 ulysses pack: the world size must divide the heads; got H={h}, W={world}")
    hl = h // world
    hi_ = hl if hi is None else hi
    if not 0 <= lo < hi_ <= hl:
        raise ValueError(f"fp8 ulysses pack: heads [lo, hi) must lie in a head group of {hl}; got [{lo}, {hi_})")


def unpacked_shape(buf_shape) -> tuple[int, ...]:
    """What the decode of a receive buffer gives: ``[W, B, S, n, Hl, D + 4]`` → ``[n, B, W*S, Hl, D]``
    (:func:`unpack_decode`); ``[W, B, S, Hl, D + 4]`` → ``[B, S, W, Hl, D]`` (:func:`inverse_decode`)."""
    if len(buf_shape) == 6:
        w, b, s, n, hl, d4 = buf_shape
        return (n, b, w * s, hl, d4 - SCALE_BYTES)
    w, b, s, hl, d4 = buf_shape
    return (b, s, w, hl, d4 - SCALE_BYTES)


def check_unpack(buf, dtype, fmt: str, dims: int, out=None) -> None:
    """The rules of :func:`unpack_decode` (``dims`` 6) and :func:`inverse_decode` (5)."""
    fp8._check_decode(buf, dtype, fmt)
    if buf.dim() != dims:
        raise ValueError("fp8 ulysses decode takes a receive buffer " + (
            "[W, B, S, n, Hl, D + 4]" if dims == 6 else "[W, B, S, Hl, D + 4] (the inverse)") +
            f"; got {tuple(buf.shape)}")
    if out is not None:
        shape = unpacked_shape(buf.shape)
        if tuple(out.shape) != shape or out.dtype != dtype or out.device != buf.device:
            raise ValueError(f"fp8 ulysses decode: out must be {shape} {dtype} on {buf.device}; got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")


# ---- the Triton launches --------------------------------------------------------------------------------------------
def _rows(t: torch.Tensor, d: int):
    """``t``'s strides in rows of ``d`` elements, or None where a row is not ``d`` contiguous elements at a multiple
    of ``d`` from the data pointer (then the caller copies it)."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return None
    st = [0 if n == 1 else s for n, s in zip(t.shape[:-1], t.stride()[:-1])]  # a size-1 dim's stride: any
    if any(s % d for s in st):
        return None
    return tuple(s // d for s in st)


def _encoded_rows(buf: torch.Tensor):
    """``(buf, its strides in encoded rows)``: ``buf`` itself where its rows are D + 4 contiguous bytes at a multiple
    of D + 4 with heads adjacent (a receive buffer or a token range of one), else a contiguous copy."""
    rows = _rows(buf, buf.shape[-1])
    if rows is None or rows[-1] not in (0, 1):
        buf = buf.contiguous()
        rows = _rows(buf, buf.shape[-1])
    return buf, rows


def _launch_pack(xs, world, lo, hi, fmt, out) -> None:
    b, s, h, d = xs[0].shape
    hl = h // world
    hs = hi - lo
    strides = [_rows(x, d) for x in xs]
    if any(st is None for st in strides) or len(set(strides)) > 1:  # one set of strides for all: copy the odd ones
        xs = [x.contiguous() for x in xs]
        strides = [_rows(xs[0], d)]
    x_b, x_t, x_h = strides[0]
    n = len(xs)
    block_d, block_r = fp8._blocks(d)
    ptrs = [xs[i] if i < n else xs[0] for i in range(3)]
    # the pointer X_i is x_i at heads [lo, ...) of group 0
    ptrs = [p[:, :, lo:] if lo else p for p in ptrs]
    grid = (triton.cdiv(s * hs, block_r), world * n, b)
    # OUT [W, B, S, n, hs, D+4]: rows per j = B*S*n*hs, per slot hs, per b S*n*hs, per token n*hs
    _pack_encode_kernel[grid](*ptrs, out, s, n, hl * x_h, x_b, x_t, x_h, b * s * n * hs, hs, s * n * hs, n * hs,
                              HL=hs, D=d, BLOCK_D=block_d, BLOCK_R=block_r, FMAX=fp8.FORMATS[fmt][1],
                              E4M3=fmt == "e4m3", num_warps=4)


def _launch_decode(buf, out, m, s_strides, o_strides, t, hl, fmt, world, b) -> None:
    d = buf.shape[-1] - SCALE_BYTES
    block_d, block_r = fp8._blocks(d)
    grid = (triton.cdiv(t * hl, block_r), world * m, b)
    _unpack_decode_kernel[grid](buf, out, t, m, *s_strides, *o_strides, HL=hl, D=d, BLOCK_D=block_d,
                                BLOCK_R=block_r, E4M3=fmt == "e4m3", OUT_BF16=out.dtype == torch.bfloat16,
                                num_warps=4)


# ---- the entry points: the Triton version where fp8.use_triton, else the torch version (the same bytes) -----------
#: (kernel, device index, variant key) → whether the Triton kernel gave the torch version's bytes at its first call
_variants: dict = {}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a kernel's result equals the torch version's: encoded rows bitwise where both scales are finite (a
    non-finite row decodes to NaN whatever its bytes), decoded tensors bitwise where finite, NaN where the other is."""
    if a.dtype == torch.uint8:
        sa, sb = (t[..., -SCALE_BYTES:].contiguous().view(torch.float32)[..., 0] for t in (a, b))
        keep = sa.isfinite()
        return bool(torch.equal(keep, sb.isfinite())) and bool(torch.equal(a[keep], b[keep]))
    fa = a.isfinite()
    return (bool(torch.equal(fa, b.isfinite())) and bool(torch.equal(a.isnan(), b.isnan()))
            and bool(torch.equal(a[fa].view(torch.uint8), b[fa].view(torch.uint8))))


def _first_use(kind: str, key: tuple, device: torch.device, fast, slow, args: tuple, out):
    """``fast(*args, out)`` (Triton) where its variant was checked equal to ``slow`` (torch), else ``slow(*args, out)``;
    an unchecked variant is checked here (both run and are compared: a host sync; inside a capture ``slow`` runs)."""
    if not fp8.use_triton(device):
        return slow(*args, out)
    k = (kind, device.index, key)
    ok = _variants.get(k)
    if ok is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return slow(*args, out)
        ref = slow(*args, None)
        try:
            got = fast(*args, None)
            why = None if _same_bytes(got, ref) else "differs from the torch version"
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile or run here: the torch version
            why = f"raised {type(e).__name__}: {str(e)[:200]}"
        ok = _variants[k] = why is None
        if not ok:
            import logging

            logging.getLogger("cp_ops").warning("cp_ops FP8 codec: the fused Triton kernel %s %s for %s on %s: using "
                                                "the torch version", kind, why, key, device)
        res = got if ok else ref
        return res if out is None else out.copy_(res)
    return (fast if ok else slow)(*args, out)


def pack_encode(xs, world: int, lo: int = 0, hi: int | None = None, fmt: str = "e4m3") -> torch.Tensor:
    """n (1 to 3) tensors ``[B, S, H, D]`` (fp32/bf16/fp16, one shape and dtype, any strides) → the contiguous uint8
    send buffer ``[W, B, S, n, hi - lo, D + 4]`` of heads ``[lo, hi)`` of every head group (slab w = head group w)
    encoded in ``fmt``. Raises ValueError for other shapes, dtypes, head ranges or formats."""
    check_pack(xs, world, lo, hi, fmt)
    key = (xs[0].dtype, fmt, xs[0].shape[3], (xs[0].shape[2] // world if hi is None else hi) - lo,
           tuple(x.data_ptr() % 16 == 0 for x in xs))  # (Triton compiles a variant per pointer alignment)
    return _first_use("pack_encode", key, xs[0].device, lambda *a: pack_encode_triton(*a[:-1]),
                      lambda *a: pack_encode_torch(*a[:-1]), (xs, world, lo, hi, fmt), None)


def unpack_decode(buf: torch.Tensor, dtype: torch.dtype, fmt: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The receive buffer ``[W, B, S, n, Hl, D + 4]`` (uint8 from :func:`pack_encode`; slab w = source rank w) →
    ``[n, B, W*S, Hl, D]`` of ``dtype`` (fp32/bf16/fp16; slot i = tensor i, tokens in rank order), new or into ``out``
    (that shape and dtype, any strides). Raises ValueError for another buffer, dtype, format or ``out``."""
    check_unpack(buf, dtype, fmt, 6, out)
    key = (dtype, fmt, buf.shape[-1] - SCALE_BYTES, buf.shape[4], buf.data_ptr() % 16 == 0,
           out is None or out.data_ptr() % 16 == 0)
    return _first_use("unpack_decode", key, buf.device, unpack_decode_triton, unpack_decode_torch, (buf, dtype, fmt),
                      out)


def inverse_decode(buf: torch.Tensor, dtype: torch.dtype, fmt: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse all-to-all's receive buffer ``[W, B, S, Hl, D + 4]`` (uint8; slab j = head group j) →
    ``[B, S, W, Hl, D]`` of ``dtype`` (this rank's tokens, every head; as the unfused decode +
    :func:`cp_ops.layout.ulysses_inverse_unpack`), new or into ``out`` (that shape and dtype, any strides). Raises
    ValueError for another buffer, dtype, format or ``out``."""
    check_unpack(buf, dtype, fmt, 5, out)
    key = (dtype, fmt, buf.shape[-1] - SCALE_BYTES, buf.shape[3], buf.data_ptr() % 16 == 0,
           out is None or out.data_ptr() % 16 == 0)
    return _first_use("inverse_decode", key, buf.device, inverse_decode_triton, inverse_decode_torch,
                      (buf, dtype, fmt), out)


# -- the torch version (any device): the unfused codec and layout copies --
def pack_encode_torch(xs, world: int, lo: int = 0, hi: int | None = None, fmt: str = "e4m3") -> torch.Tensor:
    """:func:`pack_encode` in torch ops: the encode of each tensor's heads, then the pack."""
    check_pack(xs, world, lo, hi, fmt)
    return layout.ulysses_pack([fp8.encode_torch(layout.ulysses_heads(x, world, lo, hi), fmt) for x in xs], world)


def unpack_decode_torch(buf, dtype, fmt, out=None) -> torch.Tensor:
    """:func:`unpack_decode` in torch ops: the decode, then the unpack's copy."""
    check_unpack(buf, dtype, fmt, 6, out)
    w, b, s, n, hl, d4 = buf.shape
    ref = fp8.decode_torch(buf, dtype, fmt).permute(3, 1, 0, 2, 4, 5).reshape(n, b, w * s, hl, d4 - SCALE_BYTES)
    ref = ref.contiguous()  # (the reshape is a strided view at B = 1)
    return ref if out is None else out.copy_(ref)


def inverse_decode_torch(buf, dtype, fmt, out=None) -> torch.Tensor:
    """:func:`inverse_decode` in torch ops: the decode, then the unpack's copy."""
    check_unpack(buf, dtype, fmt, 5, out)
    ref = fp8.decode_torch(buf, dtype, fmt).permute(1, 2, 0, 3, 4)
    return ref.contiguous() if out is None else out.copy_(ref)


# -- the Triton version (CUDA; Triton's interpreter on CPU tensors in the tests) --
def pack_encode_triton(xs, world: int, lo: int = 0, hi: int | None = None, fmt: str = "e4m3") -> torch.Tensor:
    """:func:`pack_encode` as one Triton kernel launch."""
    check_pack(xs, world, lo, hi, fmt)
    hi = xs[0].shape[2] // world if hi is None else hi
    out = torch.empty(packed_shape(xs[0].shape, world, lo, hi, len(xs)), dtype=torch.uint8, device=xs[0].device)
    if out.numel():
        _launch_pack(list(xs), world, lo, hi, fmt, out)
    return out


def unpack_decode_triton(buf, dtype, fmt, out=None) -> torch.Tensor:
    """:func:`unpack_decode` as one Triton kernel launch."""
    check_unpack(buf, dtype, fmt, 6, out)
    w, b, s, n, hl, d4 = buf.shape
    d = d4 - SCALE_BYTES
    if out is None:
        out = torch.empty((n, b, w * s, hl, d), dtype=dtype, device=buf.device)
    if not out.numel():
        return out
    rows = _rows(out, d)
    if rows is None:  # an out whose rows the kernel cannot address: decoded, then copied
        return out.copy_(unpack_decode_triton(buf, dtype, fmt))
    o_i, o_b, o_t, o_h = rows
    buf, (s_j, s_b, s_t, s_i, _) = _encoded_rows(buf)
    # out: source j's tokens start at j*S
    _launch_decode(buf, out, n, (s_j, s_i, s_b, s_t), (s * o_t, o_i, o_b, o_t, o_h), s, hl, fmt, w, b)
    return out


def inverse_decode_triton(buf, dtype, fmt, out=None) -> torch.Tensor:
    """:func:`inverse_decode` as one Triton kernel launch."""
    check_unpack(buf, dtype, fmt, 5, out)
    w, b, s, hl, d4 = buf.shape
    d = d4 - SCALE_BYTES
    if out is None:
        out = torch.empty((b, s, w, hl, d), dtype=dtype, device=buf.device)
    if not out.numel():
        return out
    rows = _rows(out, d)
    if rows is None:
        return out.copy_(inverse_decode_triton(buf, dtype, fmt))
    o_b, o_t, o_j, o_h = rows
    buf, (s_j, s_b, s_t, _) = _encoded_rows(buf)
    _launch_decode(buf, out, 1, (s_j, 0, s_b, s_t), (o_j, 0, o_b, o_t, o_h), s, hl, fmt, w, b)
    return out
