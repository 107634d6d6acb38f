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


register("ulysses", ulysses_attention, needs_heads_divisible=True,
         summary="all-to-all sequence<->heads; W must divide the heads")
