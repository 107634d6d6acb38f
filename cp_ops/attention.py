"""The public CP attention entry point, :func:`attention`, and the single-device :func:`local_attention`.

Data path: :func:`attention` → mode (:mod:`cp_ops.modes`: AGKV, Ulysses, ...) → op (:mod:`cp_ops._library`)
→ transport (:mod:`cp_ops.transport`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _eager
from . import _library as lib
from . import modes
from .modes import pipelined, tune
from .group import resolve_group
from .transport.base import resolve as resolve_transport
from .contract import api_checked, caller_tag, on_group_destroyed
from .validate import check_device_for_group, check_same

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
        if torch.compiler.is_compiling():
            with sdpa_kernel(_CUDA_PRIORITY, set_priority=True):
                out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
        else:
            out = _sdpa_cuda_priority(qt, kt, vt, scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)
    return out.transpose(1, 2)


# What ``sdpa_kernel(_CUDA_PRIORITY, set_priority=True)`` sets (these backends on, the others off, this order
# first), done and undone only where the current state differs: the context manager costs ~19 µs of host time
# per call, this ~2 µs (eager only; Dynamo traces the context manager).
_PRIO = [int(b) for b in _CUDA_PRIORITY]
_FLAGS = [(getattr(torch._C, f"_get_{n}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{n}"),
           getattr(SDPBackend, b) in _CUDA_PRIORITY)
          for n, b in __import__("torch.nn.attention", fromlist=["_backend_names"])._backend_names.items()]


def _sdpa_cuda_priority(qt, kt, vt, scale, attn_mask=None):
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


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any = None,
    mode: str = "auto",
    transport: str = "auto",
    scale: float | None = None,
    chunks: int | None = None,
    seq_lens: tuple[int, ...] | None = None,
    key_mask: torch.Tensor | None = None,
    tag: Any = None,
) -> torch.Tensor:
    """Context-parallel dense (non-causal) attention over the tokens of a CP group.

    Each rank passes its local shard — rank r holds the r-th of W equal contiguous token blocks — and
    gets back the attention output of its own tokens against *all* tokens of the group.

    Args:
        q, k, v: ``[B, S_local, H, D]`` (BSHD), same shape, dtype (fp32/fp16/bf16) and device.
        group: the CP group: ``None`` (default process group), a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
        mode: 'agkv' (gather K/V, keep local Q), 'ulysses' (all-to-all sequence↔heads; W must divide H),
            or 'auto' (the fastest, measured on first use: :mod:`cp_ops.modes.tune`); any name of
            ``cp_ops.modes.names()``.
        transport: 'torch' (torch.distributed: NCCL/gloo), 'fast' (NVSHMEM/P2P on one Hopper node), or
            'auto' (fast where it can run, else torch).
        scale: softmax scale; default ``1/sqrt(D)``.
        chunks: pipeline stages (communication under attention; :mod:`cp_ops.modes.pipelined`): 1 =
            transport-then-attend (bitwise equal to one device); k ≥ 2 = the mode's pipelined variant in k
            stages (AGKV: local K/V first, then the peers' pieces as they land, merged by LSE in fp32; Ulysses:
            head sub-groups, exact); None = the fastest of 1, 2, 4 measured on first use (:mod:`cp_ops.modes.tune`;
            ``CP_OPS_TUNE_MODES=0`` and code traced by ``torch.compile``: the heuristic
            :func:`cp_ops.modes.pipelined.choose_chunks`, 2 for AGKV on the fast transport, else 1).
            Every rank must pass the same value.
        seq_lens: uneven shards: W token counts in rank order, the same on every rank; rank r holds
            ``seq_lens[r]`` tokens (``seq_lens[rank] == S_local``; any split, 0 allowed; e.g.
            :func:`cp_ops.layout.shard_sizes`). Exact: the keys are the concatenation of all ranks' real tokens
            (padded blocks are moved, the real rows selected before attention). None = every rank holds S_local.
        key_mask: bool ``[B, S_local]`` key-padding mask of this rank's keys (True = attend), gathered with them and
            applied as SDPA's boolean mask over the full key sequence. With ``seq_lens`` or ``key_mask``: modes
            'agkv'/'ulysses', ``chunks`` 1 or None (:mod:`cp_ops.modes.uneven`).
        tag: the call's identity in the rank contract (:mod:`cp_ops.contract`), e.g. the layer's index or name; the
            same value on every rank for the same call. Layers of one shape are otherwise indistinguishable: with a
            tag per layer, a rank that skips one layer's attention raises ValueError on every rank at the first
            mispaired call instead of pairing the next layer with its peers' skipped one (wrong outputs). Any value
            whose ``repr`` is the same on every rank (an int, a str, a tuple of them); None = untagged. Checked in
            eager calls (code traced by ``torch.compile`` is checked without it). :func:`cp_ops.parallelize` tags
            each attention module by its path.

    Returns:
        ``[B, S_local, H, D]``, dtype of ``q``: this rank's output tokens; a tensor of its own (never a view of
        a transport's pooled buffer, so later calls do not change it).

    Autograd: forward only. Inputs may require grad (e.g. a model whose parameters do, without
    ``torch.no_grad()``): the forward runs, eager and under ``torch.compile(fullgraph=True)`` alike, saves
    nothing for backward, and the output requires grad; a backward through it (to q, k or v) raises
    RuntimeError "cp_ops.attention has no backward ...".

    Raises:
        ValueError: not 4-D; q/k/v shape, dtype or device differ; a dtype other than fp32/fp16/bf16;
            mode='ulysses' with H % W != 0; tensors on a device the group's backend cannot move; unknown mode or
            transport; chunks not None or an int ≥ 1; bad ``seq_lens``/``key_mask`` (length, values, seq_lens[rank] !=
            S_local, mask dtype/shape; chunks > 1 with either); the ranks of the group disagree on the call (mode, shape,
            dtype, transport, chunks, collective settings, call order, tag) or one rank rejected its inputs — raised
            on every rank, naming each rank's call (:mod:`cp_ops.contract`).
        RuntimeError: transport='fast' cannot run here (the message says why); torch.distributed is not
            initialized; not every rank made the call within ``CP_OPS_TIMEOUT_S``; a peer on this host exited (named,
            within about a second; :mod:`cp_ops.contract`); a backward through the output (see Autograd).

    Host cost (eager): the first call with a given (shapes, dtypes, devices, group, mode, transport, chunks;
    ``seq_lens`` and the key mask's shape) runs every check and caches its decisions; a repeat call is a dict
    lookup, one rank-contract exchange and the mode's launches and kernels, called without the ``torch.library``
    dispatcher (:mod:`cp_ops._eager`). CUDA graphs: capturable (``torch.cuda.graph`` after an eager warm-up,
    ``torch.compile(mode="reduce-overhead")``); the rank contract is checked at capture, not at replay.

    Methods: AGKV (all-gather K/V, as in Megatron-LM's context parallelism and xDiT) and DeepSpeed-Ulysses
    (Jacobs et al., 2023, arXiv:2309.14509).
    """
    if tag is not None and not torch.compiler.is_compiling():  # every exchange of this call carries the tag
        with caller_tag(tag):
            return attention(q, k, v, group=group, mode=mode, transport=transport, scale=scale, chunks=chunks,
                             seq_lens=seq_lens, key_mask=key_mask)
    # eager: the cached plan of this call (cp_ops._eager: one dict lookup, one rank-contract exchange, the mode's
    # work called directly); under torch.compile, or a call the plan does not cover: the ops below
    plan = None if torch.compiler.is_compiling() else _eager.lookup(q, k, v, group, mode, transport, chunks, seq_lens,
                                                                     key_mask)
    if plan is not None:
        wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        out = plan.run(q.detach(), k.detach(), v.detach(), scale, key_mask) if wants_grad \
            else plan.run(q, k, v, scale, key_mask)
        return _ForwardOnly.apply(out, q, k, v) if wants_grad else out
    pg = resolve_group(group)
    world_size = pg.size()
    layout_call = seq_lens is not None or key_mask is not None  # uneven shards / key mask: cp_ops.modes.uneven
    chosen, resolved = _checked(q, k, v, pg, mode, transport, chunks,
                                (seq_lens, key_mask) if layout_call else None)
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # with grad: compute on detached inputs (nothing saved for a backward, no pooled K/V kept alive), then
    # attach the output to q, k and v through a node whose backward raises
    qd, kd, vd = (q.detach(), k.detach(), v.detach()) if wants_grad else (q, k, v)
    if layout_call:
        out = uneven.attention(qd, kd, vd, mode=chosen, world_size=world_size, group_name=pg.group_name,
                               transport=resolved, scale=scale, seq_lens=seq_lens, key_mask=key_mask)
    elif world_size == 1:
        out = local_attention(qd, kd, vd, scale)
    else:
        chosen, c = tune.decide(mode, chunks, chosen, q, pg, resolved)  # 'auto'/None: measured once, then cached
        kw = dict(world_size=world_size, group_name=pg.group_name, transport=resolved, scale=scale)
        if c > 1 and chosen in pipelined.PIPELINED:
            out = pipelined.PIPELINED[chosen](qd, kd, vd, chunks=c, **kw)
        else:
            out = modes.get(chosen).fn(qd, kd, vd, **kw)
    return _ForwardOnly.apply(out, q, k, v) if wants_grad else out


def _checked(q, k, v, pg, mode: str, transport: str, chunks, layout=None) -> tuple[str, str]:
    """The input checks of :func:`attention` (on failure the peers learn it in their exchange, then this raises);
    returns (the concrete mode, the resolved transport). ``layout``: ``(seq_lens, key_mask)`` of a call that
    passes either (:func:`cp_ops.modes.uneven.check_call`), else None."""
    world_size = pg.size()
    chosen, resolved = mode, transport

    def local_checks():
        nonlocal chosen, resolved
        pipelined.check_chunks(chunks)
        check_same(("q", "k", "v"), (q, k, v))
        chosen = modes.choose(mode, q.shape[2], world_size)
        resolved = resolve_transport(transport, q.device.type)
        if world_size > 1:
            check_device_for_group(q, pg)
        if layout is not None:
            uneven.check_call(q, chosen, world_size, pg.rank(), chunks, *layout)

    api_checked(pg, "cp_ops.attention", local_checks)
    return chosen, resolved


class _ForwardOnly(torch.autograd.Function):
    """``out`` unchanged (no copy), attached to the autograd graph of ``q, k, v`` by a backward that raises
    (:func:`cp_ops._library.refuse_grad`, an op whose fake kernel lets AOTAutograd trace the joint graph)."""

    @staticmethod
    def forward(ctx, out, q, k, v):
        ctx.shape = q.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        g = lib.refuse_grad(grad, ctx.shape, "attention")
        return None, g, g, g


modes.load_builtin()  # the mode functions, imported with the core (never inside traced code)
on_group_destroyed(lambda pg: _eager.forget())  # eager plans hold their group: drop them when it is destroyed
from .modes import uneven  # noqa: E402  (seq_lens / key_mask; imports local_attention from here)
