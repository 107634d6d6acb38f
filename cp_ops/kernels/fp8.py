"""The FP8 communication codec: a tensor ``[..., D]`` (fp32/bf16/fp16) ↔ one byte buffer ``[..., D + 4]`` (uint8).

Each row of ``D`` values (one (token, head)) carries its own scale, so one collective moves both and every layout of
:mod:`cp_ops.layout` works on the encoded tensor unchanged:

    bytes [0, D)      the D values, x / scale rounded to the fp8 format (round to nearest even, saturated)
    bytes [D, D + 4)  scale, fp32 (native byte order), scale = max(amax, 2**-100) / fp8_max

The rule, its error bound and the non-finite rule: docs/fp8.md ("The codec"). :func:`encode` / :func:`decode` run the
torch version, or on CUDA one fused Triton kernel each where :func:`self_test` found it bitwise equal on that device.
"""

from __future__ import annotations

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
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)  # exact: a max
    # the divisor is a tensor on x's device for an IEEE division (as the Triton kernel's div_rn): CUDA divides by a
    # Python scalar as a multiply by its fp32 reciprocal, one ulp off amax / 448 for some amax
    scale = amax.clamp_min_(AMAX_FLOOR).div_(amax.new_full((), fmax))  # [..., 1] fp32
    q = torch.div(x, scale).clamp_(-fmax, fmax).to(dt)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def _scales(buf: torch.Tensor) -> torch.Tensor:
    """The fp32 scales ``[..., 1]`` of an encoded buffer (a view where the bytes are 4-aligned, else a copy)."""
    raw = buf[..., -SCALE_BYTES:]
    try:
        return raw.view(torch.float32)
    except RuntimeError:  # D % 4 != 0 or strided: not 4-aligned in place (contiguous() could keep a slice's offset)
        return raw.clone(memory_format=torch.contiguous_format).view(torch.float32)


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
        """fp32 ``y`` (|y| <= the format's max, or NaN) → the fp8 byte, round to nearest even in integer ops (torch's
        cast's rounding, whatever the compiler's fp8 cast does); NaN → 0x7F | sign, as torch."""
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
        # the sign as a bit: Triton's unary minus (0 - v) makes -(+0) +0, where torch decodes the byte 0x80 to -0
        return (v.to(tl.uint32, bitcast=True) | ((b & 0x80).to(tl.uint32) << 24)).to(tl.float32, bitcast=True)

    @triton.jit
    def _quantize(x, FMAX: tl.constexpr, E4M3: tl.constexpr):
        """An fp32 tile ``[R, BLOCK_D]`` (columns past D loaded as 0) → (its fp8 bytes uint8, each row's fp32 scale
        ``[R]``): the codec's encode, shared by every encoding kernel."""
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 7.888609052210118e-31)  # 2**-100
        # a NaN in the row makes its scale NaN, as torch's max does (tl.max / tl.maximum dropped NaN on a Hopper GPU);
        # NaN values pass the clamp, as in torch.clamp
        amax = tl.where(tl.max((x != x).to(tl.int32), axis=1) > 0, _bits_f32(amax, 0x7FC00000), amax)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32))
        y = tl.math.div_rn(x, scale[:, None])
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))
        return _to_fp8_bits(y, E4M3), scale

    @triton.jit
    def _store_scales(row_out, scale, rm, D: tl.constexpr):
        """Each row's fp32 scale as bytes ``[D, D + 4)`` of its encoded row (``row_out``: the rows' first bytes)."""
        sb = scale.to(tl.uint32, bitcast=True)
        for i in tl.static_range(4):
            tl.store(row_out + D + i, ((sb >> (8 * i)) & 0xFF).to(tl.uint8), mask=rm)

    @triton.jit
    def _load_scales(row_in, rm, D: tl.constexpr):
        """The fp32 scales ``[R]`` of encoded rows (``row_in``: the rows' first bytes; any byte alignment)."""
        sb = tl.zeros(row_in.shape, tl.uint32)
        for i in tl.static_range(4):
            sb = sb | (tl.load(row_in + D + i, mask=rm, other=0).to(tl.uint32) << (8 * i))
        return sb.to(tl.float32, bitcast=True)

    @triton.jit
    def _dequantize(q, scale, E4M3: tl.constexpr, OUT_BF16: tl.constexpr):
        """fp8 bytes ``[R, BLOCK_D]`` and their rows' scales ``[R]`` → the decoded fp32 tile (bf16 rounded from the
        fp32 bits with ``OUT_BF16``); the codec's decode, shared by every decoding kernel."""
        y = _from_fp8_bits(q, E4M3) * scale[:, None]
        if OUT_BF16:  # round to nearest even from the bits, as torch's cast (NaN → 0x7FC0, as torch: the rounding
            u = y.to(tl.uint32, bitcast=True)  # add would carry the GPU's NaN 0x7FFFFFFF into the sign: -0)
            r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
            y = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return y

    @triton.jit
    def _encode_kernel(X, OUT, n_rows, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                       FMAX: tl.constexpr, E4M3: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        rm = rows < n_rows
        m = rm[:, None] & (cols[None, :] < D)
        x = tl.load(X + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        q, scale = _quantize(x, FMAX, E4M3)
        row_out = OUT + rows * (D + 4)
        tl.store(row_out[:, None] + cols[None, :], q, mask=m)
        _store_scales(row_out, scale, rm, D)

    @triton.jit
    def _decode_kernel(BUF, OUT, n_rows, so_r, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                       E4M3: tl.constexpr, OUT_BF16: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        rm = rows < n_rows
        m = rm[:, None] & (cols[None, :] < D)
        row_in = BUF + rows * (D + 4)
        q = tl.load(row_in[:, None] + cols[None, :], mask=m, other=0)
        y = _dequantize(q, _load_scales(row_in, rm, D), E4M3, OUT_BF16)
        tl.store(OUT + rows[:, None] * so_r + cols[None, :], y.to(OUT.dtype.element_ty), mask=m)


def _blocks(d: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(d)
    return block_d, max(1, min(64, 4096 // block_d))


def encode_triton(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """:func:`encode_torch` as one fused Triton kernel (CUDA)."""
    _check_encode(x, fmt)
    x = x.contiguous()
    d = x.shape[-1]
    out = torch.empty(encoded_shape(x.shape), dtype=torch.uint8, device=x.device)
    n = x.numel() // d if d else 0
    if n:
        block_d, block_r = _blocks(d)
        _encode_kernel[(triton.cdiv(n, block_r),)](x, out, n, D=d, BLOCK_D=block_d, BLOCK_R=block_r,
                                                   FMAX=FORMATS[fmt][1], E4M3=fmt == "e4m3", num_warps=4)
    return out


def decode_triton(buf: torch.Tensor, dtype: torch.dtype, fmt: str) -> torch.Tensor:
    """:func:`decode_torch` as one fused Triton kernel (CUDA)."""
    _check_decode(buf, dtype, fmt)
    buf = buf.contiguous()
    d = buf.shape[-1] - SCALE_BYTES
    out = torch.empty((*buf.shape[:-1], d), dtype=dtype, device=buf.device)
    n = out.numel() // d
    if n:
        block_d, block_r = _blocks(d)
        _decode_kernel[(triton.cdiv(n, block_r),)](buf, out, n, d, D=d, BLOCK_D=block_d, BLOCK_R=block_r,
                                                   E4M3=fmt == "e4m3", OUT_BF16=dtype == torch.bfloat16, num_warps=4)
    return out


_checked: dict = {}


def use_triton(device: torch.device) -> bool:
    """True when :func:`encode` / :func:`decode` run the Triton kernels on ``device``: CUDA with Triton, once
    :func:`self_test` (at the first call per device, outside a capture) found them bitwise equal to torch's."""
    if triton is None or device.type != "cuda":
        return False
    ok = _checked.get(device.index)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():  # the self-test syncs: the torch version while capturing
            return False
        ok = _checked[device.index] = self_test(device) is None
    return ok


def self_test(device: torch.device) -> str | None:
    """Compare the Triton kernels with the torch version on ``device`` (every binade of both formats, zero and tiny
    rows, bf16/fp16/fp32): None when bitwise equal, else what differed (logged). Synchronizes the device."""
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
    return bad


def nonfinite_rule(enc, dec, dtype: torch.dtype, fmt: str, device) -> str | None:
    """Check the non-finite rule on an encode/decode pair (``enc(x, fmt)``, ``dec(buf, dtype, fmt)``): a row holding
    a NaN or ±inf arrives all NaN, finite rows beside it stay finite. None when it holds, else what broke."""
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(4, 32, generator=g, device=device).to(dtype)
    x[0, 3], x[1, 7], x[2, 0] = float("nan"), float("inf"), float("-inf")
    out = dec(enc(x, fmt), dtype, fmt)
    if not bool(out[:3].isnan().all()):
        return f"non-finite rows {fmt} {dtype}: {int((~out[:3].isnan()).sum())} of 96 values arrived not NaN"
    if not bool(torch.isfinite(out[3]).all()):
        return f"non-finite rows {fmt} {dtype}: the finite row beside them arrived non-finite"
    return None


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x [..., D]`` (fp32/bf16/fp16) → uint8 ``[..., D + 4]`` in format ``fmt`` ('e4m3' / 'e5m2'; module
    docstring). Raises ValueError for another dtype or format."""
    return encode_triton(x, fmt) if use_triton(x.device) else encode_torch(x, fmt)


def decode(buf: torch.Tensor, dtype: torch.dtype, fmt: str) -> torch.Tensor:
    """uint8 ``[..., D + 4]`` (what :func:`encode` gave) → ``[..., D]`` of ``dtype``. Raises ValueError for a buffer
    that is not uint8 with a last dim > 4, or another output dtype / format."""
    return decode_triton(buf, dtype, fmt) if use_triton(buf.device) else decode_torch(buf, dtype, fmt)


def round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``decode(encode(x))``: a tensor as it arrives after crossing the link in ``fmt`` (the one-device emulation)."""
    return decode(encode(x, fmt), x.dtype, fmt)
