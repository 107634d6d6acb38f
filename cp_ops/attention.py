"""Context-parallel attention modes composed from the ops: AGKV and Ulysses.

Data path: :func:`attention` → mode (:func:`agkv_attention` / :func:`ulysses_attention`) → op
(:mod:`cp_ops._library`) → transport (:mod:`cp_ops.transport`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _library as lib
from . import layout
from .group import resolve_group
from .transport.base import resolve as resolve_transport
from .validate import api_checked, check_device_for_group, check_heads_divisible, check_same

MODES = ("auto", "agkv", "ulysses")
_CUDA_PRIORITY = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Single-device dense attention on BSHD tensors: ``[B, Sq, H, D]`` × ``[B, Skv, H, D]`` → ``[B, Sq, H, D]``.

    ``F.scaled_dot_product_attention``; on CUDA the cuDNN backend is tried first (on H200 about twice as
    fast as torch's flash backend), then flash, memory-efficient and math.
    """
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.is_cuda:
        with sdpa_kernel(_CUDA_PRIORITY, set_priority=True):
            out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    return out.transpose(1, 2)


def choose_mode(mode: str, heads: int, world_size: int) -> str:
    """``auto`` → 'ulysses' when the CP world size divides the head count, else 'agkv'."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    if mode == "auto":
        return "ulysses" if heads % world_size == 0 else "agkv"
    if mode == "ulysses":
        check_heads_divisible(heads, world_size)
    return mode


def agkv_attention(q, k, v, *, world_size: int, group_name: str, transport: str, scale=None):
    """AGKV: gather every rank's K/V, attend with the local Q. Shapes as :func:`attention`."""
    k_full, v_full = torch.ops.cp_ops.agkv_gather_start(k, v, world_size, group_name, transport)
    return local_attention(q, lib.wait(k_full), lib.wait(v_full), scale)


def ulysses_attention(q, k, v, *, world_size: int, group_name: str, transport: str, scale=None):
    """Ulysses: all-to-all sequence → heads, attend on H/W heads of the full sequence, all-to-all back."""
    buf = lib.wait(torch.ops.cp_ops.ulysses_start([q, k, v], world_size, group_name, transport))
    qh, kh, vh = (layout.ulysses_unpack(buf, i) for i in range(3))
    out = local_attention(qh, kh, vh, scale)
    back = lib.wait(torch.ops.cp_ops.ulysses_inverse_start(out, world_size, group_name, transport))
    return layout.ulysses_inverse_unpack(back)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    mode: str = "auto",
    transport: str = "auto",
    scale: float | None = None,
) -> torch.Tensor:
    """Context-parallel dense (non-causal) attention over the tokens of a CP group.

    Each rank passes its local shard — rank r holds the r-th of W equal contiguous token blocks — and
    gets back the attention output of its own tokens against *all* tokens of the group.

    Args:
        q, k, v: ``[B, S_local, H, D]`` (BSHD), same shape, dtype (fp32/fp16/bf16) and device.
        group: the CP group: ``None`` (default process group), a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
        mode: 'agkv' (gather K/V, keep local Q), 'ulysses' (all-to-all sequence↔heads; W must divide H),
            or 'auto' (Ulysses when W divides H, else AGKV).
        transport: 'torch' (torch.distributed: NCCL/gloo), 'fast' (NVSHMEM/P2P on one Hopper node), or
            'auto' (fast where it can run, else torch).
        scale: softmax scale; default ``1/sqrt(D)``.

    Returns:
        ``[B, S_local, H, D]``, dtype of ``q``: this rank's output tokens.

    Raises:
        ValueError: not 4-D; q/k/v shape, dtype or device differ; a dtype other than fp32/fp16/bf16;
            mode='ulysses' with H % W != 0; tensors on a device the group's backend cannot move; unknown mode or
            transport; the ranks of the group disagree on the call (mode, shape, dtype, transport, collective
            settings, call order) or one rank rejected its inputs — raised on every rank, naming each rank's
            call (:mod:`cp_ops.validate`).
        RuntimeError: transport='fast' cannot run here (the message says why); torch.distributed is not
            initialized; not every rank made the call within ``CP_OPS_TIMEOUT_S``.

    Methods: AGKV (all-gather K/V, as in Megatron-LM's context parallelism and xDiT) and DeepSpeed-Ulysses
    (Jacobs et al., 2023, arXiv:2309.14509).
    """
    pg = resolve_group(group)
    world_size = pg.size()
    chosen, resolved = mode, transport

    def local_checks():
        nonlocal chosen, resolved
        check_same(("q", "k", "v"), (q, k, v))
        chosen = choose_mode(mode, q.shape[2], world_size)
        resolved = resolve_transport(transport, q.device.type)
        if world_size > 1:
            check_device_for_group(q, pg)

    api_checked(pg, "cp_ops.attention", local_checks)
    if world_size == 1:
        return local_attention(q, k, v, scale)
    fn = ulysses_attention if chosen == "ulysses" else agkv_attention
    return fn(q, k, v, world_size=world_size, group_name=pg.group_name, transport=resolved, scale=scale)
