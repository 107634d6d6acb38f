"""The CP collectives as public eager functions: group in, waited tensors out (for overlap, call the launches
``torch.ops.cp_ops.*_start`` and ``wait_tensor`` yourself). ``comm_dtype`` as :func:`cp_ops.attention`'s:
:func:`agkv_gather` moves K and V, :func:`ulysses_all_to_all` up to three tensors named ``q, k, v`` by position,
:func:`ulysses_all_to_all_inverse` the output (``"o"``); what arrives is :func:`cp_ops.kernels.fp8.round_trip` of
the plain result (``docs/fp8.md``, "The collectives").
"""

from __future__ import annotations

from typing import Any

import torch

from . import comm_dtype as cd
from . import layout as _lay
from . import ops
from .comm import OpCodec, OpComm
from .contract import api_checked, variant_tag
from .group import resolve_group
from .transport import base as transport_base
from .transport.base import resolve as resolve_transport
from .validate import check_device_for_group, check_heads_divisible, check_same, check_seq_divisible


def _prepare(api, names, tensors, group, transport, more_checks=None, comm_dtype=None, mode="ulysses"):
    """Checks (every rank raises when one rank's fail): ``(pg, transport, fmts)``, ``fmts`` those of (q, k, v, o)."""
    pg = resolve_group(group)
    resolved, fmts = transport, cd.NONE

    def local_checks():
        nonlocal resolved, fmts
        check_same(names, tensors)
        check_device_for_group(tensors[0], pg)
        resolved = resolve_transport(transport, tensors[0].device.type)
        if comm_dtype is not None:
            fmts = cd.for_mode(cd.normalize(comm_dtype, tensors[0].dtype), mode)
            if fmts != cd.NONE and len(tensors) > 3:
                raise ValueError(f"{api} with an FP8 comm_dtype moves at most 3 tensors (named q, k, v by position, as "
                                 f"cp_ops.attention's); got {len(tensors)}: call it once per group of 3")
        if more_checks is not None:
            more_checks(pg.size())

    api_checked(pg, api, local_checks)
    return pg, resolved, fmts


def _fp8_comm(api, pg, transport, fmts, seq_lens=None) -> OpComm:
    """The mode bodies' comm for one FP8 collective, its exchange named ``api`` with the formats as variant."""
    return OpComm(pg.size(), pg.group_name, transport, api, variant_tag(comm_dtype=cd.tag(fmts)), pg.rank(),
                  seq_lens, OpCodec(fmts))


def _pooled(tr: str, pg, t: torch.Tensor) -> bool:
    """Whether the op's outputs were views of the transport's reused buffers."""
    return t.numel() != 0 and transport_base.for_group(tr, pg, t.device).pooled_outputs


def _owned(out: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``out``, or a copy of it if it shares memory with the (pooled) buffer ``buf``."""
    same = out.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    return out.clone(memory_format=torch.contiguous_format) if same else out


def _layout(layout: str, tensors) -> bool:
    """True for 'bhsd' (the caller transposes in and out); checks 'bshd' inputs by :func:`cp_ops.attention`'s rule."""
    if layout == "bhsd":
        return True
    if layout != "bshd":
        raise ValueError(f"layout must be 'bshd' ([B, S, H, D]) or 'bhsd' ([B, H, S, D]); got {layout!r}")
    for i, t in enumerate(tensors):
        _lay.check_not_bhsd(f"tensor {i}", t)
    return False


def _t(x):
    return x.transpose(1, 2)


def agkv_gather(
    k: torch.Tensor, v: torch.Tensor, *, group: Any = None, transport: str = "auto", seq_lens=None,
    layout: str = "bshd", comm_dtype: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather K and V over the CP group, tokens in rank order.

    Args:
        k, v: ``[B, S_local, H, D]``, same shape/dtype/device.
        seq_lens: uneven shards, as :func:`cp_ops.attention`'s (``seq_lens[rank] == S_local``).
        layout: 'bshd' (default) or 'bhsd', as :func:`cp_ops.attention`'s.
        comm_dtype: None (default) or k's dtype (the plain gather), ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``
            (or ``'e4m3'`` / ``'e5m2'``), or a dict whose ``"k"`` and ``"v"`` entries agree: K and V travel as FP8
            and arrive decoded, in k's dtype.
    Returns:
        ``(k_full, v_full)``, each ``[B, W * S_local, H, D]`` (``[B, sum(seq_lens), H, D]`` with ``seq_lens``:
        every rank's real tokens), contiguous, tensors of their own.
    Raises:
        ValueError / RuntimeError: as :func:`cp_ops.attention` (bad ``seq_lens`` or ``comm_dtype``, K and V in
            different formats, ranks that disagree).
    """
    if _layout(layout, (k, v)):
        kf, vf = agkv_gather(_t(k), _t(v), group=group, transport=transport, seq_lens=seq_lens, comm_dtype=comm_dtype)
        return _t(kf), _t(vf)
    uneven = None if seq_lens is None else \
        (lambda w: _lay.check_seq_lens(seq_lens, w, resolve_group(group).rank(), k.shape[1]))
    pg, tr, fmts = _prepare("cp_ops.agkv_gather", ("k", "v"), (k, v), group, transport, uneven, comm_dtype, "agkv")
    sh = _shards(seq_lens, pg, k.shape[1], k.device)
    pad, rows = (_same, _same) if sh is None else (sh.pad, sh.rows)
    if fmts != cd.NONE:  # decoded into tensors of their own
        kf, vf, _ = _fp8_comm("cp_ops.agkv_gather", pg, tr, fmts, seq_lens).agkv(pad(k), pad(v)).wait()
        return rows(kf).contiguous(), rows(vf).contiguous()
    kf, vf = torch.ops.cp_ops.agkv_gather_start(pad(k), pad(v), pg.size(), pg.group_name, tr, "", 0, _list(seq_lens))
    kf, vf = ops.wait(kf), ops.wait(vf)
    k_out, v_out = rows(kf), rows(vf)  # (views of kf, vf where every block is full or the split a prefix)
    if _pooled(tr, pg, kf):
        return _owned(k_out, kf), _owned(v_out, vf)
    return k_out.contiguous(), v_out.contiguous()  # (B > 1 under a prefix split: the promised contiguous copy)


def ulysses_all_to_all(
    *xs: torch.Tensor, group: Any = None, transport: str = "auto", seq_lens=None, layout: str = "bshd",
    comm_dtype: Any = None
) -> list[torch.Tensor]:
    """Ulysses sequence → heads all-to-all of n tensors in one collective.

    Args:
        xs: n tensors ``[B, S_local, H, D]``, same shape/dtype/device; W must divide H.
        seq_lens: uneven shards, as :func:`agkv_gather`'s (``seq_lens[rank] == S_local``).
        layout: 'bshd' (default) or 'bhsd': every tensor in and out in that layout (as :func:`cp_ops.attention`).
        comm_dtype: None (default) or the tensors' dtype; an FP8 dtype (every tensor; n ≤ 3); or a dict naming
            ``xs[0], xs[1], xs[2]`` as ``"q", "k", "v"``: those travel as FP8 and arrive decoded in their dtype.
    Returns:
        n tensors ``[B, W * S_local, H / W, D]`` (``[B, sum(seq_lens), H / W, D]`` with ``seq_lens``): the full
        sequence, this rank's head group (heads ``[r*H/W, (r+1)*H/W)``). Views of one fresh buffer when B = 1 and
        the shards are even (copies where the transport pools its receive buffers).
    Raises:
        ValueError: H % W != 0, bad ``seq_lens``, a bad ``comm_dtype`` (or FP8 with more than 3 tensors), and the
            rules of :func:`cp_ops.attention`.
    """
    if _layout(layout, xs):
        return [_t(o) for o in ulysses_all_to_all(*(_t(x) for x in xs), group=group, transport=transport,
                                                   seq_lens=seq_lens, comm_dtype=comm_dtype)]
    names = tuple(f"xs[{i}]" for i in range(len(xs)))

    def more(w):
        check_heads_divisible(xs[0].shape[2], w)
        if seq_lens is not None:
            _lay.check_seq_lens(seq_lens, w, resolve_group(group).rank(), xs[0].shape[1])

    pg, tr, fmts = _prepare("cp_ops.ulysses_all_to_all", names, xs, group, transport, more, comm_dtype)
    sh = _shards(seq_lens, pg, xs[0].shape[1], xs[0].device)
    sent = list(xs) if sh is None else [sh.pad(x) for x in xs]

    def rows(b):
        unpack = lambda b: [_lay.ulysses_unpack(b, i) for i in range(len(xs))]  # noqa: E731
        return unpack(b) if sh is None else list(sh.ulysses_rows(b, unpack))

    if any(fmts[:len(xs)]):  # views of one decoded buffer of their own
        return rows(_fp8_comm("cp_ops.ulysses_all_to_all", pg, tr, fmts, seq_lens).ulysses(sent).wait())
    buf = ops.wait(torch.ops.cp_ops.ulysses_start(sent, pg.size(), pg.group_name, tr, "", 0, _list(seq_lens)))
    outs = rows(buf)
    return [_owned(o, buf) for o in outs] if _pooled(tr, pg, buf) else outs


def ulysses_all_to_all_inverse(x: torch.Tensor, *, group: Any = None, transport: str = "auto",
                               seq_lens=None, layout: str = "bshd", comm_dtype: Any = None) -> torch.Tensor:
    """Ulysses heads → sequence all-to-all, the inverse of :func:`ulysses_all_to_all`.

    Args:
        x: ``[B, S, H_local, D]`` — the full sequence, this rank's head group; W must divide S (no ``seq_lens``).
        seq_lens: uneven shards: W token counts in rank order, the same on every rank, summing to S; rank r
            gets back tokens ``[sum(seq_lens[:r]), sum(seq_lens[:r+1]))``.
        layout: 'bshd' (default) or 'bhsd', as :func:`cp_ops.attention`'s.
        comm_dtype: None (default) or x's dtype; an FP8 dtype, or a dict whose ``"o"`` entry is one: x travels as
            FP8 and arrives decoded, x's dtype.
    Returns:
        ``[B, S / W, W * H_local, D]`` (``[B, seq_lens[rank], W * H_local, D]``): this rank's token block, all
        heads; a new tensor.
    Raises:
        ValueError: W does not divide S (without ``seq_lens``); bad ``seq_lens`` (length, values, sum != S,
            ranks that disagree on it); a bad ``comm_dtype``; the rules of :func:`cp_ops.attention`.
    """
    if _layout(layout, (x,)):
        return _t(ulysses_all_to_all_inverse(_t(x), group=group, transport=transport, seq_lens=seq_lens,
                                             comm_dtype=comm_dtype))
    check = (lambda w: check_seq_divisible(x.shape[1], w)) if seq_lens is None else \
        (lambda w: _lay.check_seq_lens(seq_lens, w, total=x.shape[1]))
    pg, tr, fmts = _prepare("cp_ops.ulysses_all_to_all_inverse", ("x",), (x,), group, transport, check, comm_dtype)
    if seq_lens is None:
        sent, rows = x, _lay.ulysses_inverse_unpack
    else:
        sh = _lay.Shards(seq_lens, pg.size(), pg.rank(), seq_lens[pg.rank()], x.device)
        sent, rows = sh.repad(x), sh.inverse_rows
    if fmts[3]:
        return rows(_fp8_comm("cp_ops.ulysses_all_to_all_inverse", pg, tr, fmts, seq_lens).ulysses_inverse(sent).wait())
    return rows(ops.wait(torch.ops.cp_ops.ulysses_inverse_start(sent, pg.size(), pg.group_name, tr, "", 0,
                                                                _list(seq_lens))))


def _shards(seq_lens, pg, s_local: int, device):
    return None if seq_lens is None else _lay.Shards(seq_lens, pg.size(), pg.rank(), s_local, device)


def _list(seq_lens):
    return None if seq_lens is None else list(seq_lens)


def _same(t):
    return t
