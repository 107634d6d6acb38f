"""Single-device attention that also returns the log-sum-exp (LSE) of each query row, for LSE merges.

Kernels, the fastest first (the first that accepts the inputs is remembered per (device, dtype, D)):

* CUDA, fp16/bf16 only: cuDNN (its LSE ``[B, H, Sq, 1]`` squeezed), then torch's flash kernel. Called past SDPA's
  dispatcher, which checks dtypes, the cuDNN op accepted fp32 and returned NaN (torch 2.11, Hopper).
* CUDA, any dtype: the memory-efficient kernel (its LSE padded to a multiple of 32 queries, sliced), then fp32 math.
* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (what SDPA runs on CPU), then fp32 math.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
_choice: dict[tuple, str] = {}  # (device type, dtype, D) -> kernel name that worked
_HALF = (torch.float16, torch.bfloat16)


def _half_only(qt, name: str) -> None:
    if qt.dtype not in _HALF:
        raise RuntimeError(f"{name} attention is called for fp16/bf16 only; got {qt.dtype}")


def _cudnn(qt, kt, vt, scale):
    _half_only(qt, "cuDNN")
    out, lse = aten._scaled_dot_product_cudnn_attention(qt, kt, vt, None, True, 0.0, False, False, scale=scale)[:2]
    return out, (lse.squeeze(-1) if lse.dim() == 4 else lse)


def _flash(qt, kt, vt, scale):
    _half_only(qt, "flash")
    return aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, False, False, scale=scale)[:2]


def _efficient(qt, kt, vt, scale):
    out, lse = aten._scaled_dot_product_efficient_attention(qt, kt, vt, None, True, 0.0, False, scale=scale)[:2]
    return out, lse[..., : qt.shape[-2]]  # the kernel pads the query axis of its LSE to a multiple of 32


def _cpu_flash(qt, kt, vt, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu(qt, kt, vt, 0.0, False, scale=scale)


def _math(qt, kt, vt, scale):
    """fp32 reference: scores, LSE, softmax @ V (memory O(Sq·Skv); the last resort)."""
    s = scale if scale is not None else qt.shape[-1] ** -0.5
    scores = torch.matmul(qt.float(), kt.float().transpose(-1, -2)) * s
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vt.float())
    return out.to(qt.dtype), lse


_KERNELS = {"cudnn": _cudnn, "flash": _flash, "efficient": _efficient, "cpu_flash": _cpu_flash, "math": _math}
_ORDER = {"cuda": ("cudnn", "flash", "efficient", "math"), "cpu": ("cpu_flash", "math")}


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, *,
                       dense: bool = False):
    """Dense non-causal attention of BSHD ``q`` ``[B, Sq, H, D]`` over ``k, v`` ``[B, Skv, H, D]``.

    Returns ``(out, lse)``: ``out`` ``[B, Sq, H, D]`` (a BSHD view, dtype of q), ``lse`` ``[B, H, Sq]`` fp32 (natural
    log of the softmax denominator of the scaled scores; the kernel's strides). ``scale`` default ``1/sqrt(D)``.
    ``dense=True``: the caller made every last dim unit-stride (:func:`dense_rows`), not checked again.
    Raises RuntimeError when no kernel accepted the inputs (with the last kernel's error)."""
    if not dense:
        q, k, v = dense_rows(q, k, v)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    key = (q.device.type, q.dtype, q.shape[-1])
    first = _choice.get(key)
    if first is not None:  # the kernel that worked for this (device, dtype, D) before: no try on the hot path
        try:
            out, lse = _KERNELS[first](qt, kt, vt, scale)
            return out.transpose(1, 2), lse
        except (RuntimeError, NotImplementedError):  # this shape is not for it: try the others
            pass
    err = None
    for name in _ORDER.get(q.device.type, ("math",)):
        if name == first:
            continue
        try:
            out, lse = _KERNELS[name](qt, kt, vt, scale)
        except (RuntimeError, NotImplementedError) as e:  # kernel rejects dtype / head dim / arch / shape
            err = e
            continue
        if first is None:
            _choice[key] = name
        return out.transpose(1, 2), lse
    raise RuntimeError(f"cp_ops: no attention kernel with LSE accepted {q.dtype} D={q.shape[-1]} on {q.device}: {err}")


def dense_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``(q, k, v)``, each with unit stride along its last dim (a copy only where not: e.g. q of a fused
    ``[..., D, 3]`` qkv): the kernels here are called past SDPA's dispatcher, and the CPU flash kernel read a strided
    head dim as dense and returned wrong numbers."""
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous():  # the usual case (is_contiguous: the cheapest)
        return q, k, v
    return _dense_rows(q), _dense_rows(k), _dense_rows(v)


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def kernel_for(device_type: str, dtype: torch.dtype, head_dim: int) -> str | None:
    """The kernel name chosen for these inputs so far (None before the first call): for reports."""
    return _choice.get((device_type, dtype, head_dim))
