"""Ulysses mode: all-to-all sequence → heads, attend on H/W heads of the full sequence, all-to-all back
(DeepSpeed-Ulysses, Jacobs et al., 2023, arXiv:2309.14509). W must divide H."""

from __future__ import annotations

import torch

from .. import _library as lib
from .. import layout
from ..attention import local_attention
from . import register


def ulysses_attention(q, k, v, *, world_size: int, group_name: str, transport: str, scale=None) -> torch.Tensor:
    """Ulysses: all-to-all sequence → heads, attend on H/W heads of the full sequence, all-to-all back."""
    buf = lib.wait(torch.ops.cp_ops.ulysses_start([q, k, v], world_size, group_name, transport))
    qh, kh, vh = (layout.ulysses_unpack(buf, i) for i in range(3))
    out = local_attention(qh, kh, vh, scale)
    back = lib.wait(torch.ops.cp_ops.ulysses_inverse_start(out, world_size, group_name, transport))
    return layout.ulysses_inverse_unpack(back)


def _ulysses_eager(q, k, v, pg, transport, scale=None) -> torch.Tensor:
    """Eager Ulysses without the dispatcher (cp_ops._eager): all-to-all, wait, attention, all-to-all back, wait,
    a copying unpack (never a view of a pooled buffer). ``transport``: a Transport object."""
    buf, work = transport.ulysses_start([q, k, v], pg)
    work.wait()
    qh, kh, vh = layout.ulysses_unpack_all(buf)  # views for B = 1 (the strides ulysses_unpack gives)
    out = local_attention(qh, kh, vh, scale)
    back, work = transport.ulysses_inverse_start(out, pg)
    work.wait()
    return layout.ulysses_inverse_unpack(back)


# what the rank contract compares for an eager call (one exchange): the signature of cp_ops::ulysses_start([q, k, v])
# with chunks=1, so it never equals a bare all-to-all of the same tensors (which has no inverse to follow)
_ulysses_eager.signature = lambda q, k, v, chunks: ("cp_ops::ulysses_start", q, 3, 1)
ulysses_attention.eager = _ulysses_eager

register("ulysses", ulysses_attention, needs_heads_divisible=True,
         summary="all-to-all sequence<->heads; W must divide the heads")
