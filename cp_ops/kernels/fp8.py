"""The FP8 communication codec: a tensor ``[..., D]`` (fp32/bf16/fp16) ↔ one byte buffer ``[..., D + 4]`` (uint8).

Each row of ``D`` values (one (token, head) of a ``[B, S, H, D]`` tensor) is quantized on the sender with its own
scale and carried with it, so one collective moves both and every layout of :mod:`cp_ops.layout` (which moves rows
of the last dim) works on the encoded tensor unchanged:

    bytes [0, D)      the D values, x / scale rounded to the fp8 format (round to nearest even, saturated)
    bytes [D, D + 4)  scale, fp32 (native byte order), scale = max(amax, 2**-100) / fp8_max

``amax`` = max |x| over the row in fp32; ``fp8_max`` = 448 (e4m3fn) or 57344 (e5m2). The floor 2**-100 keeps the
scale a normal fp32 (rows of zeros or tiny values give no inf/NaN: a zero row decodes to zeros). Decoding is
``fp8_value * scale`` in fp32, rounded once to the output dtype. Error of one round trip, per element: at most
half an fp8 ulp of ``|x| / scale`` — relative ``2**-4`` (e4m3, 3 mantissa bits) or ``2**-3`` (e5m2) of ``|x|``
for normal fp8 values, and ``scale · 2**-10`` (e4m3) / ``scale · 2**-17`` (e5m2) absolute below the fp8 normal range
— plus the output dtype's rounding.

Kernels: :func:`encode` / :func:`decode` run the torch ops of :func:`encode_torch` / :func:`decode_torch` (any
device; what CI runs) or, on CUDA with Triton, one fused Triton kernel each (one read, one write; the same math:
IEEE division, RTNE casts — bitwise equal to the torch version on every finite input on an H200; the self-test
checks that and the non-finite rule on each device, else the torch version runs: docs/fp8.md, the gpu-marked tests of
tests/test_fp8.py).
The ``torch.library`` ops ``cp_ops::fp8_encode`` / ``cp_ops::fp8_decode`` (:mod:`cp_ops.ops`) wrap them for traced
code.
"""

from __future__ import annotations

import math

import torch

try:  # Triton ships with torch's Linux CUDA wheels; absent on CPU-only builds
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

#: bytes of the scale carried after the D payload bytes of every row
SCALE_BYTES = 4
#: the floor of a row's amax (a normal fp32 after the division by fp8_max: no inf/NaN for zero or tiny rows)
AMAX_FLOOR = 2.0 ** -100
#: the formats by name (what the ops, the variant tag and the docs say) → (torch dtype, largest finite value)
FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
_BY_DTYPE = {dt: name for name, (dt, _) in FORMATS.items()}


def format_name(dtype) -> str:
    """'e4m3' / 'e5m2' for ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (or those names); ValueError else."""
    if isinstance(dtype, str) and dtype in FORMATS:
        return dtype
    try:
        name = _BY_DTYPE.get(dtype)
    except TypeError:  # unhashable (a list, a dict): not a dtype either
        name = None
    if name is None:
        raise ValueError(f"an FP8 communication format must be torch.float8_e4m3fn or torch.float8_e5m2 (or 'e4m3', "
                         f"'e5m2'); got {dtype!r}")
    return name


def encoded_shape(shape) -> tuple[int, ...]:
    """The encoded buffer's shape for a tensor of ``shape``: the last dim grows by :data:`SCALE_BYTES`."""
    return (*shape[:-1], shape[-1] + SCALE_BYTES)


def _check_encode(x: torch.Tensor, fmt: str) -> None:
    format_name(fmt)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.dim() < 1:
        raise ValueError(f"fp8 encode takes an fp32/bf16/fp16 tensor of at least 1 dim; got {x.dtype} "
                         f"{tuple(x.shape)}")


def _check_decode(buf: torch.Tensor, dtype: torch.dtype, fmt: str) -> None:
    format_name(fmt)
    if buf.dtype != torch.uint8 or buf.dim() < 1 or buf.shape[-1] <= SCALE_BYTES:
        raise ValueError(f"fp8 decode takes a uint8 buffer [..., D + {SCALE_BYTES}] with D >= 1 (cp_ops.kernels.fp8); "
                         f"got {buf.dtype} {tuple(buf.shape)}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fp8 decode writes fp32/bf16/fp16; got {dtype}")


# ---- the torch version (any device) ---------------------------------------------------------------------------
def encode_torch(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x [..., D]`` → uint8 ``[..., D + 4]`` (module docstring), in torch ops."""
    _check_encode(x, fmt)
    dt, fmax = FORMATS[fmt]
    # max |x| over the row in fp32 (exact: a max), then the scale; x / scale in fp32 (x promoted exactly)
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    # amax / fp8_max as an IEEE division on every device, as the Triton kernel's div_rn: the divisor is a tensor on
    # x's device, because torch's CUDA division by a Python (CPU) scalar multiplies by its fp32 reciprocal instead,
    # one ulp off amax / 448 for some amax (the 46-53 bytes the H200 self-test found; CPU divides either way)
    scale = amax.clamp_min_(AMAX_FLOOR).div_(amax.new_full((), fmax))  # [..., 1] fp32
    q = torch.div(x, scale).clamp_(-fmax, fmax).to(dt)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def _scales(buf: torch.Tensor) -> torch.Tensor:
    """The fp32 scales ``[..., 1]`` of an encoded buffer (a view where the bytes are 4-aligned, else a copy)."""
    d = buf.shape[-1] - SCALE_BYTES
    raw = buf[..., d:]
    try:
        return raw.view(torch.float32)
    except RuntimeError:  # D % 4 != 0, or a strided buffer: the scale bytes are not 4-aligned in place
        return raw.contiguous().view(torch.float32)


def decode_torch(buf: torch.Tensor, dtype: torch.dtype, fmt: str) -> torch.Tensor:
    """uint8 ``[..., D + 4]`` → ``[..., D]`` of ``dtype`` (module docstring), in torch ops."""
    _check_decode(buf, dtype, fmt)
    dt, _ = FORMATS[fmt]
    d = buf.shape[-1] - SCALE_BYTES
    return (buf[..., :d].view(dt).float() * _scales(buf)).to(dtype)


# ---- the fused Triton version (CUDA) ----------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _pow2(k):
        """2**k as fp32 for integer k in [-126, 127] (built from its bits: exact)."""
        return ((k + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _bits_f32(like, bits: tl.constexpr):
        """An fp32 tensor of ``like``'s shape holding the value with these bits (NaN, inf: no float literal needed)."""
        return tl.full(like.shape, bits, tl.uint32).to(tl.float32, bitcast=True)

    @triton.jit
    def _to_fp8_bits(y, E4M3: tl.constexpr):
        """fp32 ``y`` (|y| <= the format's max, or NaN) → the fp8 byte, round to nearest even, in integer ops (the same
        rounding as torch's cast; no dependence on how the compiler lowers an fp8 cast); NaN → 0x7F | sign, as torch."""
        if E4M3:
            MB: tl.constexpr = 3
            BIAS: tl.constexpr = 7
        else:
            MB: tl.constexpr = 2
            BIAS: tl.constexpr = 15
        u = y.to(tl.uint32, bitcast=True)
        sign = (u >> 31) << 7
        ex = ((u >> 23) & 0xFF).to(tl.int32)
        mant = tl.where(ex == 0, 0, (u & 0x7FFFFF) | 0x800000)  # fp32 subnormals (|y| < 2**-126) round to 0
        e = ex - 127
        e_eff = tl.maximum(e, 1 - BIAS)  # the fp8 subnormal range shares the smallest normal exponent's step
        shift = tl.minimum(23 - MB + e_eff - e, 31).to(tl.uint32)
        q = mant >> shift
        rem = mant & ((tl.full(u.shape, 1, tl.uint32) << shift) - 1)
        half = tl.full(u.shape, 1, tl.uint32) << (shift - 1)
        q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.uint32)
        bits = (((e_eff + BIAS) << MB).to(tl.uint32) + q - (1 << MB)) | sign  # a carry moves into the exponent
        bits = tl.where(y != y, sign | 0x7F, bits)
        return bits.to(tl.uint8)

    @triton.jit
    def _from_fp8_bits(b, E4M3: tl.constexpr):
        """The fp8 byte ``b`` → its fp32 value (exact; e4m3fn's NaN bytes 0x7F/0xFF → NaN, e5m2's exponent 31 → ±inf
        or NaN, as torch)."""
        if E4M3:
            MB: tl.constexpr = 3
            BIAS: tl.constexpr = 7
        else:
            MB: tl.constexpr = 2
            BIAS: tl.constexpr = 15
        b = b.to(tl.int32)
        ex = (b >> MB) & ((1 << (7 - MB)) - 1)
        m = (b & ((1 << MB) - 1)) + tl.where(ex > 0, 1 << MB, 0)
        v = m.to(tl.float32) * _pow2(tl.maximum(ex, 1) - BIAS - MB)
        if E4M3:
            v = tl.where((b & 0x7F) == 0x7F, _bits_f32(v, 0x7FC00000), v)
        else:
            v = tl.where(ex == 31, tl.where((b & 3) == 0, _bits_f32(v, 0x7F800000), _bits_f32(v, 0x7FC00000)), v)
        return tl.where((b & 0x80) != 0, -v, v)

    @triton.jit
    def _rows(r, n1, n2, n3, n4, s0, s1, s2, s3, s4):
        """Offsets ``Σ c_i · s_i`` of the rows ``r`` of a logical shape ``[n0, n1, n2, n3, n4]`` (row-major)."""
        c4 = r % n4
        r = r // n4
        c3 = r % n3
        r = r // n3
        c2 = r % n2
        r = r // n2
        c1 = r % n1
        c0 = r // n1
        return c0 * s0 + c1 * s1 + c2 * s2 + c3 * s3 + c4 * s4

    @triton.jit
    def _encode_tile(X, O, xo, oo, rm, cols, D: tl.constexpr, FMAX: tl.constexpr, E4M3: tl.constexpr):
        """Encode the rows at element offsets ``xo`` of ``X`` into the byte rows at offsets ``oo`` of ``O``."""
        m = rm[:, None] & (cols[None, :] < D)
        x = tl.load(X + xo[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 7.888609052210118e-31)  # 2**-100
        # a NaN in the row makes its scale NaN, as torch's max does (tl.max and tl.maximum may drop NaN on the GPU:
        # measured on an H200, the rows holding a NaN arrived finite); NaN values pass the clamp, as in torch.clamp
        amax = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, _bits_f32(amax, 0x7FC00000), amax)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32))
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))
        q = _to_fp8_bits(y, E4M3)
        tl.store(O + oo[:, None] + cols[None, :], q, mask=m)
        sb = scale.to(tl.uint32, bitcast=True)
        for i in tl.static_range(4):
            tl.store(O + oo + D + i, ((sb >> (8 * i)) & 0xFF).to(tl.uint8), mask=rm)

    @triton.jit
    def _decode_tile(B, O, bo, oo, rm, cols, D: tl.constexpr, E4M3: tl.constexpr, OUT_BF16: tl.constexpr):
        """Decode the byte rows at offsets ``bo`` of ``B`` into the rows at element offsets ``oo`` of ``O``."""
        m = rm[:, None] & (cols[None, :] < D)
        q = tl.load(B + bo[:, None] + cols[None, :], mask=m, other=0)
        sb = tl.zeros(bo.shape, tl.uint32)
        for i in tl.static_range(4):
            sb = sb | (tl.load(B + bo + D + i, mask=rm, other=0).to(tl.uint32) << (8 * i))
        scale = sb.to(tl.float32, bitcast=True)
        y = _from_fp8_bits(q, E4M3) * scale[:, None]
        if OUT_BF16:  # round to nearest even from the bits, as torch's cast (NaN → 0x7FC0, as torch: the rounding
            u = y.to(tl.uint32, bitcast=True)  # add would carry the GPU's NaN 0x7FFFFFFF into the sign: -0)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
            y = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(O + oo[:, None] + cols[None, :], y.to(O.dtype.element_ty), mask=m)

    #: the kernel's integer arguments: not specialized (a specialization per value class of each would compile a
    #: new variant for every layout: measured on an H200, the first calls of a model compiled for tens of seconds)
    _INTS = ("n_rows", "n1", "n2", "n3", "n4", "a0", "a1", "a2", "a3", "a4", "o0", "o1", "o2", "o3", "o4")

    @triton.jit(do_not_specialize=_INTS)
    def _codec_kernel(A0, A1, A2, O0, O1, O2, IDX, n_rows, n1, n2, n3, n4, a0, a1, a2, a3, a4, o0, o1, o2, o3, o4,
                      ENCODE: tl.constexpr, NP: tl.constexpr, INDEX_DIM: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, FMAX: tl.constexpr, E4M3: tl.constexpr,
                      OUT_BF16: tl.constexpr):
        """One pass over ``NP`` (1-3) (input, output) pairs of the same logical row shape ``[n0, .., n4]`` (program
        axis 1 picks the pair), each row read at row ``Σ c_i·a_i`` and written at row ``Σ c_i·o_i`` (strides in
        rows: ``D`` values, or ``D + 4`` bytes; so the compiler knows every row's alignment, as with a contiguous
        tensor): encode (``ENCODE``) or decode. ``INDEX_DIM`` >= 0: the input's coordinate along that dim is
        ``IDX[c]`` (a row gather: uneven shards' real rows)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        rm = rows < n_rows
        r = tl.where(rm, rows, 0)
        oo = _rows(r, n1, n2, n3, n4, o0, o1, o2, o3, o4)
        if INDEX_DIM < 0:
            ao = _rows(r, n1, n2, n3, n4, a0, a1, a2, a3, a4)
        else:  # the input's coordinate along INDEX_DIM through IDX: the rest as above, that dim's term replaced
            c4 = r % n4
            t = r // n4
            c3 = t % n3
            t = t // n3
            c2 = t % n2
            t = t // n2
            c1 = t % n1
            c0 = t // n1
            if INDEX_DIM == 0:
                c0 = tl.load(IDX + c0, mask=rm, other=0).to(tl.int64)
            elif INDEX_DIM == 1:
                c1 = tl.load(IDX + c1, mask=rm, other=0).to(tl.int64)
            elif INDEX_DIM == 2:
                c2 = tl.load(IDX + c2, mask=rm, other=0).to(tl.int64)
            elif INDEX_DIM == 3:
                c3 = tl.load(IDX + c3, mask=rm, other=0).to(tl.int64)
            else:
                c4 = tl.load(IDX + c4, mask=rm, other=0).to(tl.int64)
            ao = c0 * a0 + c1 * a1 + c2 * a2 + c3 * a3 + c4 * a4
        pair = tl.program_id(1)
        if ENCODE:
            ao = ao * D
            oo = oo * (D + 4)
            if NP == 1:
                _encode_tile(A0, O0, ao, oo, rm, cols, D, FMAX, E4M3)
            elif pair == 0:
                _encode_tile(A0, O0, ao, oo, rm, cols, D, FMAX, E4M3)
            elif pair == 1:
                _encode_tile(A1, O1, ao, oo, rm, cols, D, FMAX, E4M3)
            else:
                _encode_tile(A2, O2, ao, oo, rm, cols, D, FMAX, E4M3)
        else:
            ao = ao * (D + 4)
            oo = oo * D
            if NP == 1:
                _decode_tile(A0, O0, ao, oo, rm, cols, D, E4M3, OUT_BF16)
            elif pair == 0:
                _decode_tile(A0, O0, ao, oo, rm, cols, D, E4M3, OUT_BF16)
            elif pair == 1:
                _decode_tile(A1, O1, ao, oo, rm, cols, D, E4M3, OUT_BF16)
            else:
                _decode_tile(A2, O2, ao, oo, rm, cols, D, E4M3, OUT_BF16)


def _blocks(d: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(d)
    return block_d, max(1, min(64, 4096 // block_d))


#: the most leading dims a strided codec call takes (the Ulysses buffer's ``[W, B, S, n, Hl]``)
MAX_LEAD = 5


def _lead(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """Sizes and strides (in rows of ``t.shape[-1]`` elements) of ``t``'s leading dims (all but the last), padded in
    front to :data:`MAX_LEAD`."""
    k = t.dim() - 1
    pad = MAX_LEAD - k
    row = max(t.shape[-1], 1)
    return [1] * pad + list(t.shape[:-1]), [0] * pad + [st // row for st in t.stride()[:-1]]


def _rowwise(t: torch.Tensor) -> bool:
    """Whether the strided kernel can address ``t``: last dim contiguous, every other stride a whole number of rows
    (every layout cp_ops makes: views of contiguous ``[..., D]`` tensors and buffers)."""
    row = t.shape[-1]
    if row == 0:
        return True
    return t.stride()[-1] == 1 and all(st % row == 0 for n, st in zip(t.shape[:-1], t.stride()[:-1]) if n != 1)


def _launch(ins, outs, fmt: str, encode: bool, index=None) -> None:
    """The strided Triton pass of :func:`encode_into` / :func:`decode_into` (arguments checked by them): pairs with
    the same strides share one launch (up to three)."""
    d = outs[0].shape[-1] if not encode else ins[0].shape[-1]
    sizes = list(outs[0].shape[:-1])
    n_rows = math.prod(sizes)
    if n_rows == 0 or d == 0:
        return
    idx_dim, idx = -1, None
    if index is not None:
        idx_dim, idx = index[0] + MAX_LEAD - len(sizes), index[1]
    groups: dict = {}
    for a, o in zip(ins, outs):
        groups.setdefault((tuple(a.stride()[:-1]), tuple(o.stride()[:-1])), []).append((a, o))
    block_d, block_r = _blocks(d)
    for pairs in groups.values():
        for k in range(0, len(pairs), 3):
            part = pairs[k:k + 3]
            a_s, o_s = part[0][0], part[0][1]
            _, sa = _lead(a_s)
            n, so = _lead(o_s)  # the logical shape: the output's (an index changes the input's along its dim)
            ptr_a = [p[0] for p in part] + [part[0][0]] * (3 - len(part))
            ptr_o = [p[1] for p in part] + [part[0][1]] * (3 - len(part))
            _codec_kernel[(triton.cdiv(n_rows, block_r), len(part))](
                *ptr_a, *ptr_o, idx if idx is not None else ptr_o[0], n_rows, n[1], n[2], n[3], n[4], *sa, *so,
                ENCODE=encode, NP=len(part), INDEX_DIM=idx_dim, D=d, BLOCK_D=block_d, BLOCK_R=block_r,
                FMAX=FORMATS[fmt][1], E4M3=fmt == "e4m3", OUT_BF16=outs[0].dtype == torch.bfloat16, num_warps=4)


def encode_triton(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """:func:`encode_torch` as one fused Triton kernel (CUDA): one read, one write (strided ``x`` read in place where
    :func:`_rowwise`, else made contiguous first)."""
    _check_encode(x, fmt)
    out = torch.empty(encoded_shape(x.shape), dtype=torch.uint8, device=x.device)
    d = x.shape[-1]
    if d and x.numel():
        o = out
        if x.dim() - 1 > MAX_LEAD:
            x, o = x.reshape(-1, d), out.view(-1, d + SCALE_BYTES)
        elif not _rowwise(x):
            x = x.contiguous()
        _launch([x], [o], fmt, True)
    return out


def decode_triton(buf: torch.Tensor, dtype: torch.dtype, fmt: str) -> torch.Tensor:
    """:func:`decode_torch` as one fused Triton kernel (CUDA): one read, one write (a strided ``buf``, e.g. a token
    range of a gathered buffer, read in place where :func:`_rowwise`)."""
    _check_decode(buf, dtype, fmt)
    d = buf.shape[-1] - SCALE_BYTES
    out = torch.empty((*buf.shape[:-1], d), dtype=dtype, device=buf.device)
    if out.numel():
        o = out
        if buf.dim() - 1 > MAX_LEAD:
            buf, o = buf.reshape(-1, d + SCALE_BYTES), out.view(-1, d)
        elif not _rowwise(buf):
            buf = buf.contiguous()
        _launch([buf], [o], fmt, False)
    return out


# ---- fused into the layouts: encode straight into a send layout, decode straight into the unpacked one -------------
def _check_pairs(ins, outs, what: str, index=None) -> None:
    if len(ins) != len(outs) or not ins:
        raise ValueError(f"fp8 {what}: one output per input; got {len(ins)} inputs, {len(outs)} outputs")
    lead = tuple(outs[0].shape[:-1])
    for a, o in zip(ins, outs):
        a_lead = list(a.shape[:-1])
        if index is not None:
            a_lead[index[0]] = index[1].shape[0]
        if tuple(a_lead) != lead or tuple(o.shape[:-1]) != lead or len(lead) > MAX_LEAD:
            raise ValueError(f"fp8 {what}: inputs and outputs must have the same leading dims (at most {MAX_LEAD}; "
                             f"{'through the index ' if index is not None else ''}), got "
                             f"{[tuple(a.shape) for a in ins]} → {[tuple(o.shape) for o in outs]}")
        if a.device != o.device:
            raise ValueError(f"fp8 {what}: input on {a.device}, output on {o.device}")


def encode_into(xs, outs, fmt: str) -> None:
    """Encode each ``x [..., D]`` of ``xs`` into ``out [..., D + 4]`` (uint8) of ``outs``: any strides on both sides
    (e.g. ``out`` a slot of the Ulysses send buffer ``[W, B, S, n, Hl, D + 4]`` and ``x`` the matching view of
    ``[B, S, H, D]``), at most :data:`MAX_LEAD` leading dims, the same on both sides. One pass: on CUDA one Triton
    launch for up to three pairs of equal strides; elsewhere (and when the self-test refused Triton) the torch
    version, ``out.copy_(encode_torch(x))``: bitwise the same bytes as :func:`encode`. Raises ValueError for
    mismatched shapes or a bad dtype/format."""
    _check_pairs(xs, outs, "encode_into")
    for x, o in zip(xs, outs):
        _check_encode(x, fmt)
        if o.dtype != torch.uint8 or o.shape[-1] != x.shape[-1] + SCALE_BYTES:
            raise ValueError(f"fp8 encode_into writes uint8 [..., D + {SCALE_BYTES}]; got {o.dtype} {tuple(o.shape)} "
                             f"for an input {tuple(x.shape)}")
    if use_triton(outs[0].device) and all(_rowwise(o) for o in outs):
        _launch([x if _rowwise(x) else x.contiguous() for x in xs], outs, fmt, True)
        return
    for x, o in zip(xs, outs):
        o.copy_(encode_torch(x, fmt))


def decode_into(bufs, outs, fmt: str, index=None) -> None:
    """Decode each uint8 ``buf [..., D + 4]`` of ``bufs`` into ``out [..., D]`` of ``outs`` (its dtype: fp32/bf16/
    fp16), any strides on both sides, at most :data:`MAX_LEAD` leading dims; ``index = (dim, idx)`` (idx an int64
    tensor on the device): row ``c`` of ``out`` along leading dim ``dim`` is row ``idx[c]`` of ``buf`` (a gather:
    the real rows of uneven shards). One pass: on CUDA one Triton launch for up to three pairs of equal strides;
    elsewhere the torch version, ``out.copy_(decode_torch(buf.index_select(dim, idx)))``: bitwise the values of
    :func:`decode`. Raises ValueError for mismatched shapes or a bad dtype/format."""
    _check_pairs(bufs, outs, "decode_into", index)
    for b, o in zip(bufs, outs):
        _check_decode(b, o.dtype, fmt)
        if o.shape[-1] != b.shape[-1] - SCALE_BYTES:
            raise ValueError(f"fp8 decode_into: output [..., D] for a buffer [..., D + {SCALE_BYTES}]; got "
                             f"{tuple(b.shape)} → {tuple(o.shape)}")
    if len({o.dtype for o in outs}) != 1:
        raise ValueError(f"fp8 decode_into: the outputs must share one dtype; got {[o.dtype for o in outs]}")
    if use_triton(outs[0].device) and all(_rowwise(o) for o in outs):
        _launch([b if _rowwise(b) else b.contiguous() for b in bufs], outs, fmt, False, index)
        return
    for b, o in zip(bufs, outs):
        if index is not None:
            b = b.index_select(index[0], index[1])
        o.copy_(decode_torch(b, o.dtype, fmt))


_checked: dict = {}


def use_triton(device: torch.device) -> bool:
    """True when :func:`encode` / :func:`decode` run the fused Triton kernels for tensors on ``device``: CUDA with
    Triton, once :func:`self_test` found them bitwise equal to the torch version on this device (checked at the
    first call per device; else the torch version, logged once)."""
    if triton is None or device.type != "cuda":
        return False
    ok = _checked.get(device.index)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():  # the self-test syncs: not inside a CUDA graph capture
            return False  # (the torch version, capturable; the test runs at the first call outside a capture)
        ok = _checked[device.index] = self_test(device) is None
    return ok


def self_test(device: torch.device) -> str | None:
    """Compare the Triton kernels with the torch version on ``device`` (values across every binade of both formats,
    zero and tiny rows, bf16/fp16/fp32): None when bitwise equal, else what differed (then :func:`use_triton`
    keeps the torch version and logs why). Synchronizes the device (call it outside CUDA graph capture)."""
    import logging

    try:
        bad = _compare(device)
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile or run here: the torch version
        bad = [f"the Triton kernels raised {type(e).__name__}: {str(e)[:300]}"]
    if not bad:
        return None
    why = "; ".join(bad)
    logging.getLogger("cp_ops").warning("cp_ops FP8 codec: the Triton kernels differ from the torch version on %s "
                                        "(%s): using the torch version", device, why)
    return why


def _compare(device) -> list[str]:
    """What :func:`self_test` found different (empty: nothing)."""
    g = torch.Generator(device=device).manual_seed(0)
    sweep = torch.linspace(-1, 1, 255, device=device).repeat(8, 1) * torch.logspace(-6, 4, 8, device=device)[:, None]
    x = torch.cat([sweep[:, :128], sweep[:, 127:], torch.randn(64, 128, generator=g, device=device) * 4,
                   torch.zeros(1, 128, device=device), torch.full((1, 128), 1e-30, device=device)])
    bad = []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        xd = x.to(dt)
        for fmt in FORMATS:
            enc = encode_triton(xd, fmt)
            ref = encode_torch(xd, fmt)
            if not torch.equal(enc, ref):
                bad.append(f"encode {fmt} {dt}: {(enc != ref).sum().item()} bytes differ")
            elif not torch.equal(decode_triton(ref, dt, fmt), decode_torch(ref, dt, fmt)):
                bad.append(f"decode {fmt} {dt}")
            why = nonfinite_rule(encode_triton, decode_triton, dt, fmt, device)
            if why:
                bad.append(why)
            if dt == torch.bfloat16:  # the addressing (the same code for every dtype; tested on each: tests/)
                why = strided_rule(lambda a, o, f: _launch(a, o, f, True),
                                   lambda a, o, f, index=None: _launch(a, o, f, False, index), dt, fmt, device)
                if why:
                    bad.append(why)
    return bad


def strided_rule(enc_into, dec_into, dtype: torch.dtype, fmt: str, device) -> str | None:
    """Check the strided passes (:func:`encode_into` / :func:`decode_into`, given as ``enc_into(xs, outs, fmt)``,
    ``dec_into(bufs, outs, fmt, index=None)``) against the torch version on a Ulysses-like pack (three inputs of
    different strides, heads of each group, into slots of one send buffer), its unpack (slots into a permuted
    output), and a row gather: None when bitwise equal, else what differed."""
    g = torch.Generator(device=device).manual_seed(2)
    w, b, s, h, d, lo, hi = 2, 2, 5, 6, 128, 1, 3  # d: the head dim of the models (one compiled kernel per D)
    hl = h // w
    base = (torch.randn(b, s, h + 1, d, generator=g, device=device) * 3).to(dtype)
    xs = [base[:, :, :h], base[:, :, 1:].contiguous(), base[:, :, :h].transpose(0, 1).contiguous().transpose(0, 1)]
    views = [x.unflatten(2, (w, hl))[:, :, :, lo:hi].permute(2, 0, 1, 3, 4) for x in xs]  # [W, B, S, hs, D]
    send = torch.zeros(w, b, s, 3, hi - lo, d + SCALE_BYTES, dtype=torch.uint8, device=device)
    enc_into(views, [send[:, :, :, i] for i in range(3)], fmt)
    ref = torch.stack([encode_torch(v, fmt) for v in views], dim=3)
    if not torch.equal(send, ref):
        return f"strided encode {fmt} {dtype}: {int((send != ref).sum())} bytes differ"
    out = torch.zeros(3, b, w, s, hi - lo, d, dtype=dtype, device=device)
    dec_into([ref[:, :, :, i] for i in range(3)], [out[i].transpose(0, 1) for i in range(3)], fmt)
    if not torch.equal(out, decode_torch(ref, dtype, fmt).permute(3, 1, 0, 2, 4, 5)):
        return f"strided decode {fmt} {dtype}"
    idx = torch.tensor([4, 0, 2, 2], device=device)
    got = torch.zeros(b, 4, h, d, dtype=dtype, device=device)
    full = encode_torch(base[:, :, :h], fmt)
    dec_into([full], [got], fmt, index=(1, idx))
    if not torch.equal(got, decode_torch(full, dtype, fmt).index_select(1, idx)):
        return f"gathering decode {fmt} {dtype}"
    return None


def nonfinite_rule(enc, dec, dtype: torch.dtype, fmt: str, device) -> str | None:
    """Check the codec rule for non-finite input on an encode/decode pair (``enc(x, fmt)``, ``dec(buf, dtype, fmt)``):
    a row holding a NaN or ±inf arrives as a row of NaN (every element: its scale is inf or NaN), finite rows beside
    it unchanged by it — never finite values where the input was not finite. None when it holds, else what broke
    (the torch version holds it; :func:`self_test` asks it of the Triton kernels, whose max/clamp may drop NaN)."""
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(4, 128, generator=g, device=device).to(dtype)  # D = 128: the kernels the self-test compiled
    x[0, 3], x[1, 7], x[2, 0] = float("nan"), float("inf"), float("-inf")
    out = dec(enc(x, fmt), dtype, fmt)
    if not bool(out[:3].isnan().all()):
        return f"non-finite rows {fmt} {dtype}: {int((~out[:3].isnan()).sum())} of 384 values arrived not NaN"
    if not bool(torch.isfinite(out[3]).all()):
        return f"non-finite rows {fmt} {dtype}: the finite row beside them arrived non-finite"
    return None


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x [..., D]`` (fp32/bf16/fp16) → uint8 ``[..., D + 4]``: fp8 values of format ``fmt`` ('e4m3' / 'e5m2') and
    each row's fp32 scale (module docstring). The Triton kernel on CUDA, else torch ops. Raises ValueError for
    another dtype or format."""
    return encode_triton(x, fmt) if use_triton(x.device) else encode_torch(x, fmt)


def decode(buf: torch.Tensor, dtype: torch.dtype, fmt: str) -> torch.Tensor:
    """uint8 ``[..., D + 4]`` (what :func:`encode` gave) → ``[..., D]`` of ``dtype``. Raises ValueError for a buffer
    that is not uint8 with a last dim > 4, or another output dtype / format."""
    return decode_triton(buf, dtype, fmt) if use_triton(buf.device) else decode_torch(buf, dtype, fmt)


def round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``decode(encode(x))``: what a tensor that crossed the link in ``fmt`` looks like on arrival (the one-device
    emulation, :func:`cp_ops.kernels.fp8_emulate`)."""
    return decode(encode(x, fmt), x.dtype, fmt)
