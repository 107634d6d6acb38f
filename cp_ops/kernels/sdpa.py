"""Single-device dense attention on BSHD tensors with cp_ops' backend priority: the local attention every mode body
runs, and the reference every test compares against. Leaf module: imports torch only. On CUDA the SDPA backends are
tried in the order cuDNN, flash, memory-efficient, math (cuDNN ran about twice as fast as flash on a Hopper GPU, bf16,
H=40, D=128: ``shared/anchors.md``); SDPA skips one that cannot take the inputs. A batch row whose keys are *all* masked
gets what SDPA gives (zeros on CPU and from math; a CUDA backend may give NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

#: The CUDA backend order (the first that accepts the inputs runs).
CUDA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]

# What ``sdpa_kernel(CUDA_PRIORITY, set_priority=True)`` sets, done and undone only where the state differs: the
# context manager costs ~19 µs of host time per call, this ~2 µs (eager only; Dynamo traces the context manager).
_PRIO = [int(b) for b in CUDA_PRIORITY]
_FLAGS = [(getattr(torch._C, f"_get_{n}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{n}"),
           getattr(SDPBackend, b) in CUDA_PRIORITY)
          for n, b in __import__("torch.nn.attention", fromlist=["_backend_names"])._backend_names.items()]


def _sdpa_cuda(qt, kt, vt, scale, attn_mask=None):
    order = torch._C._get_sdp_priority_order()
    reorder = order[:len(_PRIO)] != _PRIO
    flipped = [(setter, want) for getter, setter, want in _FLAGS if getter() != want]
    if not reorder and not flipped:
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, scale=scale)
    if reorder:
        torch._C._set_sdp_priority_order(_PRIO + [b for b in order if b not in _PRIO])
    for setter, want in flipped:
        setter(want)
    try:
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, scale=scale)
    finally:
        if reorder:
            torch._C._set_sdp_priority_order(order)
        for setter, want in flipped:
            setter(not want)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Single-device dense (non-causal) attention: ``[B, Sq, H, D]`` × ``[B, Skv, H, D]`` → ``[B, Sq, H, D]``.

    ``q, k, v``: one dtype (fp32/fp16/bf16) and device; ``scale`` default ``1/sqrt(D)``; ``key_mask``: bool
    ``[B, Skv]`` or ``[B, 1, 1, Skv]`` (True = attend; the same for every query and head), or None. Returns a
    transposed view of SDPA's ``[B, H, Sq, D]`` output. Raises TypeError when ``scale`` is a tensor (a mask passed
    positionally), else as ``F.scaled_dot_product_attention``."""
    if isinstance(scale, torch.Tensor):
        raise TypeError("local_attention: the 4th positional argument is scale (a float or None), got a tensor of "
                        f"shape {list(scale.shape)}; pass the mask as key_mask=mask")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    m = None if key_mask is None else (key_mask if key_mask.dim() == 4 else key_mask[:, None, None, :])
    if not q.is_cuda:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m, scale=scale)
    elif torch.compiler.is_compiling():
        with sdpa_kernel(CUDA_PRIORITY, set_priority=True):
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m, scale=scale)
    else:
        out = _sdpa_cuda(qt, kt, vt, scale, m)
    return out.transpose(1, 2)
