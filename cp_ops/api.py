"""The public CP attention entry point, :func:`attention`, and the single-device :func:`local_attention`
(the data path: ``docs/architecture.md``)."""

from __future__ import annotations

from typing import Any, Hashable

import torch

from . import ops, plan
from .kernels import local_attention
from .plan.measured import Choice

__all__ = ["attention", "describe", "local_attention"]


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
    tag: Hashable | None = None,
    layout: str = "bshd",
    comm_dtype: Any = None,
) -> torch.Tensor:
    """Context-parallel dense (non-causal) attention over the tokens of a CP group.

    Each rank passes its local shard (rank r holds the r-th of W contiguous token blocks) and gets back the
    attention output of its own tokens against *all* tokens of the group.

    Args:
        q, k, v: ``[B, S_local, H, D]`` (BSHD), same shape, dtype (fp32/fp16/bf16) and device.
        group: the CP group: ``None`` (default process group), a ``ProcessGroup``, a 1-D ``DeviceMesh``, or a 2-D
            ``DeviceMesh`` with ``mesh_dim_names=("agkv", "ulysses")`` (2-D CP: Ulysses inside each row, AGKV across
            rows; rank r in row-major order holds the r-th token block; the inner size must divide H;
            :mod:`cp_ops.mesh`, :mod:`cp_ops.plan.mesh2d`, docs/2d.md).
        mode: 'agkv' (gather K/V, keep local Q), 'ulysses' (all-to-all sequence↔heads; W must divide H), any name of
            ``cp_ops.modes.names()``, or 'auto': the rules (:mod:`cp_ops.plan.rules`; measured on first use where
            ``CP_OPS_TUNE_MODES=1``), on a flat group across nodes the cost model's split (:mod:`cp_ops.plan.split`).
            On a 2-D mesh: 'auto' or 'agkv_ulysses'. What a call ran: :func:`describe`.
        transport: 'torch' (torch.distributed: NCCL/gloo), 'fast' (NVSHMEM/P2P on one Hopper node), or
            'auto' (fast where it can run, else torch).
        scale: softmax scale (a Python float or int); default ``1/sqrt(D)``. The same on every rank (else
            ValueError on every rank, naming each rank's scale).
        chunks: pipeline stages (communication under attention): 1 = transport-then-attend (bitwise equal to one
            device); k ≥ 2 = the mode's pipelined variant (AGKV: peers' pieces merged by LSE in fp32 as they land;
            Ulysses: head sub-groups, exact); None = :func:`cp_ops.plan.rules.chunks_rule` (2 for AGKV on the fast
            transport, else 1; 1 with ``seq_lens``/``key_mask``), or measured where asked. The same on every rank.
        seq_lens: uneven shards: W token counts in rank order, the same on every rank (``seq_lens[rank] ==
            S_local``; any split, 0 allowed; :func:`cp_ops.layout.shard_sizes`' split is the cheapest). Exact
            (:class:`cp_ops.layout.Shards`). None = every rank holds S_local.
        key_mask: bool ``[B, S_local]`` key-padding mask of this rank's keys (True = attend), gathered with them and
            applied as SDPA's boolean mask over the full key sequence (:class:`cp_ops.layout.Shards`); or bool
            ``[B, S_total]`` (``S_total = sum(seq_lens)``, else ``W * S_local``): every key of the call in rank order,
            the same on every rank, applied as given with no communication (not on a 2-D mesh given as ``group``; when
            this rank holds every token the two shapes are one, read as this rank's). AGKV with a mask runs 1 stage.
        layout: 'bshd' (default: ``[B, S_local, H, D]`` in and out) or 'bhsd' (``[B, H, S_local, D]``, SDPA's; in
            and out, transposed views). A 'bshd' tensor whose dim 2 holds more than 64 entries and more than dim 1 is
            taken for BHSD (ValueError); smaller BHSD tensors look like BSHD ones: pass ``layout=`` for BHSD.
        tag: this call site's identity for the rank contract (an int, a str, or a tuple of them; the same on every
            rank), e.g. the layer index: ranks whose calls pair different tags (a rank skipped a layer) raise on every
            rank at the first mispaired call. :func:`cp_ops.parallelize` passes each attention module's layer.
        comm_dtype: what crosses the link (``docs/fp8.md``): None (default) or q's dtype = q's dtype;
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (or ``'e4m3'`` / ``'e5m2'``) = every tensor the mode
            moves in FP8 with one fp32 scale per (token, head) (D + 4 bytes per row), decoded on arrival; a dict
            ``{"q"|"k"|"v"|"o": fp8 dtype, its name or None}`` = per tensor (AGKV and a 2-D mesh: K and V alike).
            The same on every rank. Not bitwise (docs/fp8.md); a row holding a NaN or ±inf arrives as NaN. On a
            group of one rank ignored unless ``CP_OPS_EMULATE_COMM=1``.

    Returns:
        ``[B, S_local, H, D]``, dtype of ``q``: this rank's output tokens; a tensor of its own (never a view of
        a transport's pooled buffer, so later calls do not change it).

    Autograd: forward only. Inputs may require grad: the forward runs (eager and compiled), saves nothing, and a
    backward through the output raises RuntimeError "cp_ops.attention has no backward ...".

    Raises:
        ValueError: bad shapes, dtypes or devices; a bad ``comm_dtype``, mode, transport, chunks, ``seq_lens`` or
            ``key_mask``; mode='ulysses' with H % W != 0; the ranks disagree on the call (mode, shape, dtype,
            transport, chunks, scale, comm_dtype, collective settings, call order) or one rank rejected its inputs —
            raised on every rank, naming each rank's call.
        TypeError: ``scale`` not None or a real number; ``tag`` not an int, a str or a tuple of them.
        RuntimeError: transport='fast' cannot run here (the message says why); torch.distributed is not
            initialized; not every rank made the call within ``CP_OPS_TIMEOUT_S``; a backward through the
            output (see Autograd).

    Host cost (eager): the first call with a given key runs every check and caches its decisions; a repeat call is
    a dict lookup, one rank-contract exchange and the mode's launches and kernels. CUDA graphs: capturable; the rank
    contract is checked at capture, not at replay.

    Methods: AGKV (all-gather K/V, as in Megatron-LM's context parallelism and xDiT) and DeepSpeed-Ulysses
    (Jacobs et al., 2023, arXiv:2309.14509).
    """
    bhsd = layout != "bshd" and _is_bhsd(layout)
    if bhsd:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # with grad: compute on detached inputs (nothing saved for a backward, no pooled K/V kept alive), then attach the
    # output to q, k and v through a node whose backward raises
    qd, kd, vd = (q.detach(), k.detach(), v.detach()) if grad else (q, k, v)
    out = plan.run(plan.make(qd, kd, vd, group=group, mode=mode, transport=transport, scale=scale, chunks=chunks,
                             seq_lens=seq_lens, key_mask=key_mask, tag=tag, comm_dtype=comm_dtype))
    if grad:
        out = _ForwardOnly.apply(out, q, k, v)
    return out.transpose(1, 2) if bhsd else out


def _is_bhsd(layout: str) -> bool:
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' ([B, S, H, D]) or 'bhsd' ([B, H, S, D]); got {layout!r}")
    return layout == "bhsd"


#: :func:`attention`'s keywords besides ``layout``: what :func:`describe` takes
_KEYWORDS = ("group", "mode", "transport", "scale", "chunks", "seq_lens", "key_mask", "tag", "comm_dtype")


def describe(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, *, layout: str = "bshd",
             **keywords) -> Choice:
    """What :func:`attention` picked — or, before the first such call, would pick — for a call with these arguments:
    the mode, the chunk count, the transport and why (``k``, ``v``, ``scale`` and ``tag`` are accepted, not read).
    Local: no collective, no measuring, no file read; any rank may call it alone, at any time.

    Args:
        q: the call's q (shape, dtype and device read, never the values). The keywords: as :func:`attention`.
    Returns:
        :class:`cp_ops.plan.measured.Choice`, a NamedTuple ``(mode, chunks, source, times_ms, transport, why)``:
        ``source`` one of 'explicit' (mode and chunks given), 'heuristic' (the rules of :mod:`cp_ops.plan.rules`:
        measuring off — the default —, a traced call, one rank, uneven shards or a key mask), 'cost' (``mode='auto'``
        on a flat group across nodes: the cost model's split, known from the group's first call on), 'single' (one
        candidate left), 'measured' (timed by this process's first call: ``CP_OPS_TUNE_MODES=1``), 'cached' (from
        the cache file), 'pending' (measuring on, no call made yet); ``times_ms`` the candidates' times, max over
        ranks; ``transport`` 'torch' or 'fast' ('auto' before the group's first call). Traced code runs the
        heuristic's variant: to compile a measured one, pass the ``mode`` and ``chunks`` this returns.
    Raises:
        ValueError: the checks :func:`attention` makes on this rank alone.
        TypeError: q is not a tensor; a keyword :func:`attention` does not take.
        RuntimeError: torch.distributed is not initialized; transport='fast' cannot run here.
    """
    del k, v
    unknown = sorted(keywords.keys() - set(_KEYWORDS))
    if unknown:
        raise TypeError(f"describe() got unexpected keyword arguments {unknown}: it takes attention's keywords "
                        f"({', '.join(_KEYWORDS)}) and layout")
    if _is_bhsd(layout):
        q = q.transpose(1, 2)
    keywords.update(scale=None, tag=None)  # the choice does not depend on them
    return plan.describe(plan.make(q, q, q, **keywords))


class _ForwardOnly(torch.autograd.Function):
    """``out`` unchanged, attached to the autograd graph of ``q, k, v`` by a backward that raises."""

    @staticmethod
    def forward(ctx, out, q, k, v):
        ctx.shape = q.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        g = ops.refuse_grad(grad, ctx.shape, "attention")
        return None, g, g, g
