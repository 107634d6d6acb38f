"""AGKV mode: all-gather every rank's K/V, attend with the local Q (as in Megatron-LM's context
parallelism and xDiT). Any head count; moves 2·(W-1)/W of the global K/V to every rank."""

from __future__ import annotations

import torch

from .. import _library as lib
from ..attention import local_attention
from . import register


def agkv_attention(q, k, v, *, world_size: int, group_name: str, transport: str, scale=None) -> torch.Tensor:
    """AGKV: gather every rank's K/V, attend with the local Q. Shapes as :func:`cp_ops.attention`."""
    k_full, v_full = torch.ops.cp_ops.agkv_gather_start(k, v, world_size, group_name, transport)
    return local_attention(q, lib.wait(k_full), lib.wait(v_full), scale)


def _agkv_eager(q, k, v, pg, transport, scale=None) -> torch.Tensor:
    """Eager AGKV without the dispatcher (cp_ops._eager): the transport's gather, its wait, attention.
    ``transport``: a Transport object; inputs checked and non-empty, the ranks' signatures exchanged."""
    k_full, v_full, work = transport.agkv_start(k, v, pg)
    work.wait()
    return local_attention(q, k_full, v_full, scale)


# what the rank contract compares for an eager call: the signature of cp_ops::agkv_gather_start(k, v)
_agkv_eager.signature = lambda q, k, v, chunks: ("cp_ops::agkv_gather_start", k, 2, 0)
agkv_attention.eager = _agkv_eager

register("agkv", agkv_attention, summary="gather K/V, keep local Q")
