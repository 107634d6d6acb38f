"""Merge partial attention outputs by their log-sum-exp (LSE), in fp32.

Partials ``o_i`` over key blocks i with ``lse_i = log Σ_{j∈i} exp(s_xj)`` merge to ``Σ_i exp(lse_i - LSE) o_i``,
``LSE = log Σ_i exp(lse_i)`` (Milakov & Gimelshein, 2018), computed as ``w_i = exp(lse_i - max_i lse_i)``,
``out = Σ w_i o_i / Σ w_i`` so no exponent overflows. On CUDA, one fused kernel per ≤ 4 partials: the CUDA kernel
of ``csrc/lse_merge.cu`` when this process already loaded cp_ops' extension (the fast transport does; a few µs of
host time per merge where the Triton launcher took 60 µs) and the inputs suit it (2..4 partials in the output dtype,
last dim contiguous); else the Triton kernel; else eager fp32 torch ops.
"""

from __future__ import annotations

import torch

try:  # Triton ships with torch's Linux CUDA wheels; absent on CPU-only builds
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

_MAX_N = 4  # partials per kernel launch


def merge_eager(outs: list[torch.Tensor], lses: list[torch.Tensor], dtype: torch.dtype | None = None):
    """The merge in fp32 torch ops (CPU, or CUDA without Triton). Shapes as :func:`merge`."""
    dtype = outs[0].dtype if dtype is None else dtype
    lse = torch.stack([x.float() for x in lses])  # [n, B, H, S]
    m = lse.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no keys anywhere: -inf everywhere
    w = torch.exp(lse - m)
    den = w.sum(0)
    # a row whose every partial LSE is -inf attended no key: its output is 0 (SDPA's on CPU), never 0/0 (den >= 1
    # wherever some LSE is finite: the clamp only touches den == 0, where w == 0)
    wt = (w / den.clamp_min(torch.finfo(torch.float32).tiny)).permute(0, 1, 3, 2).unsqueeze(-1)  # [n, B, S, H, 1]
    acc = wt[0] * outs[0].float()
    for i in range(1, len(outs)):
        acc = acc + wt[i] * outs[i].float()
    return acc.to(dtype)


if triton is not None:

    @triton.jit
    def _merge_kernel(O0, O1, O2, O3, L0, L1, L2, L3, OUT, LOUT, n_rows, S, H,
                      so_b, so_s, so_h, sl_b, sl_h, sl_s,
                      N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                      WRITE_LSE: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: offsets past 2**31
        rmask = rows < n_rows
        h = rows % H
        s = (rows // H) % S
        b = rows // (H * S)
        d = tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (d < D)[None, :]
        loff = b * sl_b + h * sl_h + s * sl_s
        ooff = (b * so_b + s * so_s + h * so_h)[:, None] + d[None, :]
        l0 = tl.load(L0 + loff, mask=rmask, other=float("-inf"))
        m = l0
        if N > 1:
            l1 = tl.load(L1 + loff, mask=rmask, other=float("-inf"))
            m = tl.maximum(m, l1)
        if N > 2:
            l2 = tl.load(L2 + loff, mask=rmask, other=float("-inf"))
            m = tl.maximum(m, l2)
        if N > 3:
            l3 = tl.load(L3 + loff, mask=rmask, other=float("-inf"))
            m = tl.maximum(m, l3)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(l0 - m)
        den = w
        acc = w[:, None] * tl.load(O0 + ooff, mask=mask, other=0.0).to(tl.float32)
        if N > 1:
            w = tl.exp(l1 - m)
            den += w
            acc += w[:, None] * tl.load(O1 + ooff, mask=mask, other=0.0).to(tl.float32)
        if N > 2:
            w = tl.exp(l2 - m)
            den += w
            acc += w[:, None] * tl.load(O2 + ooff, mask=mask, other=0.0).to(tl.float32)
        if N > 3:
            w = tl.exp(l3 - m)
            den += w
            acc += w[:, None] * tl.load(O3 + ooff, mask=mask, other=0.0).to(tl.float32)
        out = tl.where(den[:, None] > 0, acc / den[:, None], 0.0)  # no key anywhere (every LSE -inf): 0
        tl.store(OUT + rows[:, None] * D + d[None, :], out.to(OUT.dtype.element_ty), mask=mask)
        if WRITE_LSE:
            tl.store(LOUT + rows, m + tl.log(den), mask=rmask)


def _same_layout(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as they are when they share strides (the kernel takes one set), else contiguous copies."""
    st = ts[0].stride()
    return ts if all(t.stride() == st for t in ts) else [t.contiguous() for t in ts]


def _merge_triton(outs, lses, dtype, return_lse):
    b, s, h, d = outs[0].shape
    if outs[0].stride(-1) != 1 or any(o.stride(-1) != 1 for o in outs):
        outs = [o.contiguous() for o in outs]
    outs, lses = _same_layout(outs), _same_layout(lses)
    out = torch.empty(b, s, h, d, dtype=dtype, device=outs[0].device)
    # the merged LSE in the kernel's row order, [B, S, H] (returned as a [B, H, S] view)
    lout = torch.empty(b, s, h, dtype=torch.float32, device=out.device) if return_lse else out
    n_rows = b * s * h
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(64, 8192 // block_d))
    n = len(outs)
    po = outs + [outs[0]] * (_MAX_N - n)
    pl = lses + [lses[0]] * (_MAX_N - n)
    grid = (triton.cdiv(n_rows, block_r),)
    _merge_kernel[grid](*po, *pl, out, lout, n_rows, s, h,
                        outs[0].stride(0), outs[0].stride(1), outs[0].stride(2),
                        lses[0].stride(0), lses[0].stride(1), lses[0].stride(2),
                        N=n, D=d, BLOCK_D=block_d, BLOCK_R=block_r, WRITE_LSE=return_lse, num_warps=4)
    if return_lse:
        return out, lout.permute(0, 2, 1)  # [B, H, S] view
    return out


_EXT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _merge_ext(outs, lses, dtype):
    """The merge through the extension's CUDA kernel, or None when it is not loaded or the inputs do not suit it."""
    from .. import _ext

    ext = _ext.loaded()
    code = _EXT_DTYPES.get(dtype)
    o0, l0 = outs[0], lses[0]
    if ext is None or code is None or not 2 <= len(outs) <= _MAX_N or o0.stride(-1) != 1:
        return None
    st, lst = o0.stride(), l0.stride()
    for o, l in zip(outs, lses):
        if o.dtype != dtype or o.stride() != st or l.dtype != torch.float32 or l.stride() != lst:
            return None
    b, s, h, d = o0.shape
    out = torch.empty(b, s, h, d, dtype=dtype, device=o0.device)
    size = o0.element_size()
    vec = (d * size) % 16 == 0 and all((st[i] * size) % 16 == 0 for i in range(3)) \
        and all(o.data_ptr() % 16 == 0 for o in outs)  # out: fresh from the caching allocator (aligned)
    dev = o0.device.index
    ext.lse_merge(_ext.current_stream(o0.device), dev, code, [o.data_ptr() for o in outs],
                  [l.data_ptr() for l in lses], out.data_ptr(), b, s, h, d, st[0], st[1], st[2],
                  lst[0], lst[1], lst[2], vec)
    return out


def use_triton(device: torch.device) -> bool:
    """True when :func:`merge` runs the fused Triton kernel for tensors on ``device``."""
    return triton is not None and device.type == "cuda"


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """LSE-merge n ≥ 1 partial outputs ``[B, S, H, D]`` with their LSEs ``[B, H, S]`` (fp32) into ``[B, S, H, D]``
    of ``dtype`` (default: the partials' dtype), accumulating in fp32. Raises ValueError when there are no partials
    or their count differs from the LSEs'."""
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge needs n >= 1 partial outputs and as many LSEs; got {len(outs)} and {len(lses)}")
    dtype = outs[0].dtype if dtype is None else dtype
    if len(outs) == 1:
        return outs[0].to(dtype)
    if outs[0].device.type == "cuda":
        out = _merge_ext(outs, lses, dtype)
        if out is not None:
            return out
    if not use_triton(outs[0].device):
        return merge_eager(outs, lses, dtype)
    while len(outs) > _MAX_N:  # fold the first 4 into one fp32 partial, then go on
        o, l = _merge_triton(outs[:_MAX_N], lses[:_MAX_N], torch.float32, True)
        outs, lses = [o] + outs[_MAX_N:], [l] + lses[_MAX_N:]
    return _merge_triton(outs, lses, dtype, False)
