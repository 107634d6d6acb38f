"""Uneven shards and key-padding masks: ``cp_ops.attention(..., seq_lens=..., key_mask=...)`` and the collectives.

**The rule.** ``seq_lens`` is a tuple of W non-negative token counts, in rank order, identical on every rank:
rank r holds ``seq_lens[r]`` consecutive tokens (its ``q, k, v`` are ``[B, seq_lens[r], H, D]``) and the full
sequence is the concatenation of the ranks' blocks in rank order, ``sum(seq_lens)`` tokens. Any split is allowed:
:func:`cp_ops.layout.shard_sizes` (``torch.tensor_split``'s rule, what :func:`cp_ops.layout.shard` cuts), any
other, 0 tokens on some ranks. ``seq_lens=None`` means every rank holds this rank's ``S_local`` (the even split).

**Key-padding mask.** ``key_mask``: bool ``[B, S_local]``, True = attend this key, False = a padding key (e.g. a
text encoder's attention mask); it travels with its rank's keys (all-gathered to the full sequence, one small
uint8 collective beside K/V) and is applied as SDPA's boolean mask over the full key sequence, the same for every
query and head. The single-device reference is :func:`masked_attention` (SDPA with the same mask over the
concatenated keys). A batch row whose keys are *all* masked gets what SDPA gives for it on one device
(zeros on CPU and from the math backend in torch ≥ 2.5; a CUDA backend may give NaN): cp_ops does not change it.
Other mask kinds (additive float masks, per-query or per-head masks, another shape or device) → ValueError.

**Method** (exact; no masking of padded keys): every rank pads its block to ``S_max = max(seq_lens)`` tokens
(zeros), the transports move the padded blocks with their usual even layouts, and the receiver selects the real
rows (``torch.cat`` of W slices, one copy) before attention, so SDPA sees exactly the K/V (and mask) of one
device: bitwise equal to single-device attention on CPU where the same kernel sees the same data.

* AGKV: pad K/V → gather ``[B, W*S_max, H, D]`` → real K/V rows → SDPA with the local (unpadded) Q.
* Ulysses: pad Q/K/V → all-to-all → real Q/K/V rows of the full sequence (H/W heads) → SDPA → re-pad the output
  to ``[B, W*S_max, H/W, D]`` → the inverse all-to-all (``cp_ops::ulysses_inverse_uneven_start``) → this rank keeps
  the first ``seq_lens[rank]`` rows of its block. With the torch transport the padding is written straight into the
  all-to-all's send buffer (pad and pack in one copy, as its even pack). (Attending the padded queries instead would save two copies but is
  not bitwise: CPU SDPA's result for a row depends on the query count, by 2e-7 in a test.)

**Eager calls** take a cached plan (:class:`EagerPlan`, keyed in :mod:`cp_ops._eager` by the even call's key plus
``seq_lens`` and the mask's shape, dtype and device; the mask's values are data, read at every call): the same
method with padded shapes, offsets, the rank contract's tagged signature and the index tensors that select the real
rows computed once, so a repeat call is a dict lookup, one exchange (named after the call's first op, with chunks=1
for Ulysses) and the transport's launches: padding is copied into one fresh buffer (its rows are never read, so
never written), the real rows are taken by one ``index_select`` (``take`` for the mask), the torch transport's
collectives are called directly (AGKV: K, V and the mask in one coalesced all-gather). Bitwise equal to the ops
(``tests/test_uneven_plan.py``). Compiled code, tracing and dispatch modes use the ops.

**Ops** (``torch.library``; launches like :mod:`cp_ops._library`'s, outputs valid after ``wait_tensor``; exact fake
kernels, so ``torch.compile(fullgraph=True)`` traces them, each rank its own shapes):

* ``cp_ops::agkv_gather_uneven_start(k, v, key_mask?, seq_lens, world_size, group_name, transport)``
  → ``(k_pad [B, W*S_max, H, D], v_pad, mask [W, B, S_max] uint8, or [0] without a mask)``
* ``cp_ops::ulysses_uneven_start(xs, key_mask?, seq_lens, world_size, group_name, transport)``
  → ``(buf [W, B, S_max, n, H/W, D], mask)``
* ``cp_ops::ulysses_inverse_uneven_start(x, seq_lens, world_size, group_name, transport)``:
  ``x [B, sum(seq_lens), H/W, D]`` → ``buf [W, B, S_max, H/W, D]``

Each copies its inputs into private padded buffers before the launch (the transport then never reads a buffer a
compiler may reuse; these ops have no Inductor lowering of their own; the torch transport's Ulysses packs them
into its send buffer, which is that copy) and folds a hash of ``(seq_lens, key_mask
given)`` into the rank contract's per-call signature (:func:`cp_ops.contract.exchange`'s ``tag``): ranks that
disagree raise ValueError on every rank, naming each rank's ``seq_lens``.

**Pipelined variants** (``chunks`` ≥ 2) assume equal shards and no mask: ``chunks=k > 1`` with ``seq_lens`` or
``key_mask`` raises ValueError; ``chunks=None`` runs 1 stage. Modes other than 'agkv' and 'ulysses' raise too.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from .. import _library as lib
from .. import contract, layout, validate
from .._hooks import run_compile_hooks
from ..attention import _CUDA_PRIORITY, _sdpa_cuda_priority, local_attention
from ..transport import base as transport_base

#: The modes that take ``seq_lens`` / ``key_mask``.
MODES = ("agkv", "ulysses")
_U8 = torch.uint8


# ---- input rules (public API, fake and real kernels) ---------------------------------------------
def check_seq_lens(seq_lens, world_size: int, rank: int | None = None, s_local: int | None = None,
                   total: int | None = None) -> None:
    """``seq_lens`` must be W non-negative ints (rank order); ``seq_lens[rank] == s_local`` and
    ``sum(seq_lens) == total`` where given. Raises ValueError naming the rule and the values seen."""
    if not isinstance(seq_lens, (tuple, list)):
        raise ValueError(f"seq_lens must be a tuple of {world_size} token counts (one per rank of the CP group, in "
                         f"rank order) or None; got {type(seq_lens).__name__} {seq_lens!r}")
    if len(seq_lens) != world_size:
        raise ValueError(f"seq_lens must have one token count per rank of the CP group (world_size={world_size}); "
                         f"got {len(seq_lens)}: {list(seq_lens)}")
    for n in seq_lens:
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
            raise ValueError(f"seq_lens must hold ints; got {type(n).__name__} {n!r} in {list(seq_lens)}")
        validate._require(n >= 0, lambda: f"seq_lens must be non-negative token counts; got {list(seq_lens)}")
    if rank is not None and s_local is not None:
        validate._require(seq_lens[rank] == s_local, lambda: (
            f"seq_lens[rank] must equal this rank's local token count (q.shape[1]); got seq_lens={list(seq_lens)}, "
            f"rank={rank}, S_local={s_local}"))
    if total is not None:
        validate._require(sum(seq_lens) == total, lambda: (
            f"sum(seq_lens) must equal the full sequence length x.shape[1]; got seq_lens={list(seq_lens)} "
            f"(sum {sum(seq_lens)}), x.shape[1]={total}"))


def check_key_mask(key_mask, x: torch.Tensor) -> None:
    """``key_mask`` must be a bool ``[B, S_local]`` tensor on ``x``'s device (``x``: ``[B, S_local, H, D]``)."""
    if not isinstance(key_mask, torch.Tensor):
        raise ValueError(f"key_mask must be a bool tensor [B, S_local] (True = attend this key, False = padding) or "
                         f"None; got {type(key_mask).__name__}")
    if key_mask.dtype != torch.bool:
        raise ValueError(f"key_mask must be a bool key-padding mask (True = attend, False = padding); additive float "
                         f"masks are not supported; got dtype {key_mask.dtype} (for a 0/1 mask pass mask > 0)")
    b, s = x.shape[0], x.shape[1]
    validate._require(key_mask.dim() == 2 and key_mask.shape[0] == b and key_mask.shape[1] == s, lambda: (
        f"key_mask must be [B, S_local] = [{b}, {s}] (one flag per key of this rank, the same for every query and "
        f"head; per-query and per-head masks are not supported); got shape {tuple(key_mask.shape)}"))
    if key_mask.device != x.device:
        raise ValueError(f"key_mask must be on the device of q/k/v ({x.device}); got {key_mask.device}")


def check_call(q: torch.Tensor, mode: str, world_size: int, rank: int, chunks, seq_lens, key_mask) -> None:
    """The rules of ``cp_ops.attention(..., seq_lens=, key_mask=)`` beyond the even call's (ValueError)."""
    if chunks is not None and chunks > 1:
        raise ValueError(f"chunks > 1 (the pipelined variants) is not supported with seq_lens or key_mask (they "
                         f"assume equal shards and no mask); got chunks={chunks}: pass chunks=1 or None")
    if world_size > 1 and mode not in MODES:
        raise ValueError(f"seq_lens / key_mask are supported by modes {MODES}; got mode={mode!r}")
    if seq_lens is not None:
        check_seq_lens(seq_lens, world_size, rank, q.shape[1])
    if key_mask is not None:
        check_key_mask(key_mask, q)


# ---- helpers -------------------------------------------------------------------------------------
def s_max(seq_lens) -> int:
    """``max(seq_lens)`` (``torch.sym_max`` where a count is symbolic: no guard on it; plain ``max`` for ints,
    which torch 2.11's Dynamo needs: it refuses a ``torch.sym_max`` that returns an int)."""
    m = seq_lens[0]
    for n in seq_lens[1:]:
        m = max(m, n) if isinstance(m, int) and isinstance(n, int) else torch.sym_max(m, n)
    return m


def _pad(x: torch.Tensor, smax) -> torch.Tensor:
    """A private contiguous copy of ``x`` ``[B, S, ...]`` padded with zeros to ``[B, smax, ...]``."""
    s = x.shape[1]
    if s == smax:
        return x.clone(memory_format=torch.contiguous_format)
    return F.pad(x, (0, 0) * (x.dim() - 2) + (0, smax - s)).contiguous()


def _repad(x: torch.Tensor, seq_lens, smax) -> torch.Tensor:
    """``[B, sum(seq_lens), ...]`` → ``[B, W*smax, ...]``: block r at ``r*smax``, zeros after its ``seq_lens[r]`` rows
    (``x`` itself when every block is full)."""
    if all(n == smax for n in seq_lens):
        return x
    b, rest, w = x.shape[0], x.shape[2:], len(seq_lens)
    out = x.new_zeros(b, w, smax, *rest)
    off = 0
    for r, n in enumerate(seq_lens):
        out[:, r, :n].copy_(x[:, off:off + n])
        off = off + n
    return out.view(b, w * smax, *rest)


def real_rows(full: torch.Tensor, seq_lens, smax) -> torch.Tensor:
    """``[B, W*smax, ...]`` (padded blocks in rank order) → ``[B, sum(seq_lens), ...]``, the real rows (one copy;
    ``full`` itself when every block is full)."""
    if all(n == smax for n in seq_lens):
        return full
    return torch.cat([full.narrow(1, r * smax, n) for r, n in enumerate(seq_lens)], dim=1)


def ulysses_real(buf: torch.Tensor, i: int, seq_lens, smax) -> torch.Tensor:
    """Slot ``i`` of a received Ulysses buffer ``[W, B, smax, n, Hl, D]`` as ``[B, sum(seq_lens), Hl, D]``, real rows."""
    if all(n == smax for n in seq_lens):
        return layout.ulysses_unpack(buf, i)
    return torch.cat([buf[r, :, :n, i] for r, n in enumerate(seq_lens)], dim=1)


def mask_real(m: torch.Tensor, seq_lens) -> torch.Tensor:
    """A gathered mask ``[W, B, smax]`` uint8 → bool ``[B, sum(seq_lens)]``."""
    return torch.cat([m[r, :, :n] for r, n in enumerate(seq_lens)], dim=1) != 0


def inverse_rows(back: torch.Tensor, s_local) -> torch.Tensor:
    """A received inverse buffer ``[W, B, smax, Hl, D]`` → this rank's ``[B, s_local, W*Hl, D]`` (a new tensor)."""
    w, b, smax, hl, d = back.shape
    if s_local == smax:
        return layout.ulysses_inverse_unpack(back)
    return back[:, :, :s_local].permute(1, 2, 0, 3, 4).clone(memory_format=torch.contiguous_format).view(
        b, s_local, w * hl, d)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                     key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Single-device attention with a key-padding mask, the reference of ``cp_ops.attention(..., key_mask=)``.

    ``q`` ``[B, Sq, H, D]``, ``k``/``v`` ``[B, Skv, H, D]``, ``key_mask`` bool ``[B, Skv]`` (True = attend) or None
    (:func:`cp_ops.local_attention`) → ``[B, Sq, H, D]``. SDPA with ``attn_mask=key_mask[:, None, None, :]``; on
    CUDA the backends in :func:`cp_ops.local_attention`'s order (one that cannot take a mask is skipped).

    Raises:
        TypeError: ``scale`` is a tensor (a mask passed as the 4th positional argument: pass ``key_mask=``)."""
    if isinstance(scale, torch.Tensor):
        raise TypeError("masked_attention: the 4th positional argument is scale (a float or None), got a tensor of "
                        f"shape {list(scale.shape)}; pass the mask as key_mask=mask")
    if key_mask is None:
        return local_attention(q, k, v, scale)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    m = key_mask[:, None, None, :]
    if q.is_cuda:
        with sdpa_kernel(_CUDA_PRIORITY, set_priority=True):
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m, scale=scale)
    return out.transpose(1, 2)


# ---- the rank contract: seq_lens and the mask's presence in the per-call signature --------------
_tags: dict = {}


def _tag(seq_lens, has_mask: bool) -> tuple[int, str]:
    key = (tuple(seq_lens), has_mask)
    got = _tags.get(key)
    if got is None:
        note = f"seq_lens={list(seq_lens)} key_mask={'given' if has_mask else 'None'}"
        got = _tags[key] = (zlib.crc32(repr(key).encode()) & 0x7FFFFFFF or 1, note)
    return got


def _like(x: torch.Tensor, s) -> torch.Tensor:
    """``x`` if it has ``s`` tokens, else a meta tensor of ``x``'s shape with ``s`` tokens: what the rank contract
    compares (every rank's padded shape)."""
    if x.shape[1] == s:
        return x
    return torch.empty((x.shape[0], s, *x.shape[2:]), dtype=x.dtype, device="meta")


def _checked(pg, op: str, transport: str, rules, seq_lens, has_mask: bool, extra: int, make_t):
    """An op's real kernel: its rules, then ``make_t()`` (the padded tensor whose shape every rank shares), then the
    rank contract's exchange with the ``seq_lens`` tag. Returns ``make_t()``'s tensor."""
    tag, note = _tag(seq_lens, has_mask)
    try:
        rules()
    except (ValueError, RuntimeError, TypeError) as e:
        contract.exchange(pg, op, transport, None, extra, failed=e, tag=tag, note=note)
        raise
    t = make_t()
    contract.exchange(pg, op, transport, t, extra, tag=tag, note=note)
    return t


def _mask_start(pg, key_mask: torch.Tensor | None, smax, world_size: int, like: torch.Tensor) -> torch.Tensor:
    """Launch the all-gather of the (padded) mask: ``[W, B, smax]`` uint8 (``[0]`` when there is no mask)."""
    if key_mask is None:
        return like.new_empty(0, dtype=_U8)
    mp = _pad(key_mask.to(_U8), smax)
    out = mp.new_empty(world_size * mp.shape[0], smax)  # gloo wants [W*B, smax]; the work is keyed by storage
    if out.numel():
        lib._register(pg._allgather_base(out, mp), out)
    return out.view(world_size, *mp.shape)


def _fake_mask(key_mask, world_size, b, smax, like):
    return like.new_empty(world_size, b, smax, dtype=_U8) if key_mask is not None else like.new_empty(0, dtype=_U8)


# ---- AGKV ----------------------------------------------------------------------------------------
@torch.library.custom_op("cp_ops::agkv_gather_uneven_start", mutates_args=())
def agkv_gather_uneven_start(
    k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor], seq_lens: list[int], world_size: int,
    group_name: str, transport: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pg = lib._group(world_size, group_name)

    def rules():
        validate.check_same(("k", "v"), (k, v))
        check_seq_lens(seq_lens, world_size, pg.rank(), k.shape[1])
        if key_mask is not None:
            check_key_mask(key_mask, k)

    smax = max(seq_lens) if seq_lens else 0
    kp = _checked(pg, "cp_ops::agkv_gather_uneven_start", transport, rules, seq_lens, key_mask is not None, 2,
                  lambda: _pad(k, smax))
    vp = _pad(v, smax)
    b, _, h, d = k.shape
    if kp.numel() == 0:
        kf, vf = k.new_empty(b, world_size * smax, h, d), v.new_empty(b, world_size * smax, h, d)
    else:
        kf, vf, work = lib._transport(transport, pg, kp).agkv_start(kp, vp, pg)
        lib._register(work, kf, vf)
    return kf, vf, _mask_start(pg, key_mask, smax, world_size, k)


@agkv_gather_uneven_start.register_fake
def _(k, v, key_mask, seq_lens, world_size, group_name, transport):
    run_compile_hooks()
    validate.check_same(("k", "v"), (k, v))
    check_seq_lens(seq_lens, world_size)
    smax = s_max(seq_lens)
    b, _, h, d = k.shape
    return (k.new_empty(b, world_size * smax, h, d), v.new_empty(b, world_size * smax, h, d),
            _fake_mask(key_mask, world_size, b, smax, k))


# ---- Ulysses, sequence → heads -------------------------------------------------------------------
@torch.library.custom_op("cp_ops::ulysses_uneven_start", mutates_args=())
def ulysses_uneven_start(
    xs: list[torch.Tensor], key_mask: Optional[torch.Tensor], seq_lens: list[int], world_size: int, group_name: str,
    transport: str
) -> tuple[torch.Tensor, torch.Tensor]:
    pg = lib._group(world_size, group_name)

    def rules():
        validate.check_same(tuple(f"xs[{i}]" for i in range(len(xs))), tuple(xs))
        validate.check_heads_divisible(xs[0].shape[2], world_size)
        check_seq_lens(seq_lens, world_size, pg.rank(), xs[0].shape[1])
        if key_mask is not None:
            check_key_mask(key_mask, xs[0])

    smax = max(seq_lens) if seq_lens else 0
    _checked(pg, "cp_ops::ulysses_uneven_start", transport, rules, seq_lens, key_mask is not None, len(xs),
             lambda: _like(xs[0], smax))
    b, s, h, d = xs[0].shape
    n, w = len(xs), world_size
    if b * smax * h * d == 0:
        buf = xs[0].new_empty(w, b, smax, n, h // w, d)
    else:
        tr = lib._transport(transport, pg, xs[0])
        if tr.name == "torch":  # pad and pack in one copy (the torch transport reads nothing after the launch)
            send = xs[0].new_empty(w, b, smax, n, h // w, d)
            if s < smax:
                send[:, :, s:].zero_()
            for i, x in enumerate(xs):
                send[:, :, :s, i].copy_(x.reshape(b, s, w, h // w, d).permute(2, 0, 1, 3, 4))
            buf = torch.empty_like(send)
            work = pg.alltoall_base(buf, send, [], [])
        else:
            buf, work = tr.ulysses_start([_pad(x, smax) for x in xs], pg)
        lib._register(work, buf)
    return buf, _mask_start(pg, key_mask, smax, world_size, xs[0])


@ulysses_uneven_start.register_fake
def _(xs, key_mask, seq_lens, world_size, group_name, transport):
    run_compile_hooks()
    validate.check_same(tuple(f"xs[{i}]" for i in range(len(xs))), tuple(xs))
    validate.check_heads_divisible(xs[0].shape[2], world_size)
    check_seq_lens(seq_lens, world_size)
    smax = s_max(seq_lens)
    b, _, h, d = xs[0].shape
    return (xs[0].new_empty(world_size, b, smax, len(xs), h // world_size, d),
            _fake_mask(key_mask, world_size, b, smax, xs[0]))


# ---- Ulysses, heads → sequence -------------------------------------------------------------------
@torch.library.custom_op("cp_ops::ulysses_inverse_uneven_start", mutates_args=())
def ulysses_inverse_uneven_start(
    x: torch.Tensor, seq_lens: list[int], world_size: int, group_name: str, transport: str
) -> torch.Tensor:
    pg = lib._group(world_size, group_name)

    def rules():
        validate.check_same(("x",), (x,))
        check_seq_lens(seq_lens, world_size, total=x.shape[1])

    smax = max(seq_lens) if seq_lens else 0
    _checked(pg, "cp_ops::ulysses_inverse_uneven_start", transport, rules, seq_lens, False, 1,
             lambda: _like(x, len(seq_lens) * smax))
    b, _, hl, d = x.shape
    w = world_size
    if b * smax * hl * d == 0:
        return x.new_empty(w, b, smax, hl, d)
    tr = lib._transport(transport, pg, x)
    if tr.name == "torch":  # re-pad and pack in one copy: slab r = rank r's block, zeros after its rows
        send = x.new_empty(w, b, smax, hl, d)
        off = 0
        for r, n in enumerate(seq_lens):
            send[r, :, :n].copy_(x[:, off:off + n])
            if n < smax:
                send[r, :, n:].zero_()
            off += n
        buf = torch.empty_like(send)
        work = pg.alltoall_base(buf, send, [], [])
    else:
        xp = _repad(x, seq_lens, smax)
        if xp is x:
            xp = x.clone(memory_format=torch.contiguous_format)  # private: the transport reads it after the launch
        buf, work = tr.ulysses_inverse_start(xp, pg)
    lib._register(work, buf)
    return buf


@ulysses_inverse_uneven_start.register_fake
def _(x, seq_lens, world_size, group_name, transport):
    run_compile_hooks()
    validate.check_same(("x",), (x,))
    check_seq_lens(seq_lens, world_size, total=x.shape[1])
    b, _, hl, d = x.shape
    return x.new_empty(world_size, b, s_max(seq_lens), hl, d)


def _save_shapes(ctx, inputs, output):
    # per input, in order: a float tensor's shape, a list of tensors' shapes, or None (no gradient)
    def shape(x):
        if isinstance(x, torch.Tensor):
            return x.shape if x.is_floating_point() else None
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
            return [t.shape for t in x]
        return None

    ctx.shapes = [shape(x) for x in inputs]


def _no_backward(name: str):
    def backward(ctx, *grads):
        g = next(x for x in grads if x is not None)
        return tuple(None if s is None else [lib.refuse_grad(g, t, name) for t in s] if isinstance(s, list)
                     else lib.refuse_grad(g, s, name) for s in ctx.shapes)

    return backward


for _op, _name in ((agkv_gather_uneven_start, "agkv_gather_uneven_start"),
                   (ulysses_uneven_start, "ulysses_uneven_start"),
                   (ulysses_inverse_uneven_start, "ulysses_inverse_uneven_start")):
    _op.register_autograd(_no_backward(_name), setup_context=_save_shapes)
    contract.register_op(_op._qualname)

#: The launches of this file (a compiler integration may lower them as it lowers ``cp_ops._library.LAUNCH_OPS``).
UNEVEN_LAUNCH_OPS = (
    torch.ops.cp_ops.agkv_gather_uneven_start.default,
    torch.ops.cp_ops.ulysses_uneven_start.default,
    torch.ops.cp_ops.ulysses_inverse_uneven_start.default,
)


# ---- attention -----------------------------------------------------------------------------------
def attention(q, k, v, *, mode: str, world_size: int, group_name: str, transport: str, scale=None, seq_lens=None,
              key_mask=None) -> torch.Tensor:
    """``cp_ops.attention`` with ``seq_lens`` and/or ``key_mask`` (see the module docstring), after its checks
    (:func:`check_call`). ``q, k, v`` ``[B, seq_lens[rank], H, D]`` → ``[B, seq_lens[rank], H, D]``, q's dtype."""
    if world_size == 1:
        return masked_attention(q, k, v, scale, key_mask)
    seq = list(seq_lens) if seq_lens is not None else [q.shape[1]] * world_size
    smax = s_max(seq)
    if mode == "agkv":
        kf, vf, mf = torch.ops.cp_ops.agkv_gather_uneven_start(k, v, key_mask, seq, world_size, group_name,
                                                                 transport)
        kf, vf = real_rows(lib.wait(kf), seq, smax), real_rows(lib.wait(vf), seq, smax)
        mask = None if key_mask is None else mask_real(lib.wait(mf), seq)
        return masked_attention(q, kf, vf, scale, mask)
    if mode != "ulysses":
        raise ValueError(f"seq_lens / key_mask are supported by modes {MODES}; got mode={mode!r}")
    buf, mf = torch.ops.cp_ops.ulysses_uneven_start([q, k, v], key_mask, seq, world_size, group_name, transport)
    buf = lib.wait(buf)
    qh, kh, vh = (ulysses_real(buf, i, seq, smax) for i in range(3))  # [B, sum(seq), Hl, D]: real rows
    mask = None if key_mask is None else mask_real(lib.wait(mf), seq)
    out = masked_attention(qh, kh, vh, scale, mask)  # [B, sum(seq), Hl, D]
    if all(n == smax for n in seq):
        back = torch.ops.cp_ops.ulysses_inverse_start(out, world_size, group_name, transport)
    else:  # re-pad to the even layout and back
        back = torch.ops.cp_ops.ulysses_inverse_uneven_start(out, seq, world_size, group_name, transport)
    return inverse_rows(lib.wait(back), q.shape[1])


# ---- the eager plan (cp_ops._eager): a repeated call without the ops ---------------------------------
def eager_plan(q: torch.Tensor, pg, mode: str, transport: str, seq_lens, has_mask: bool):
    """The plan of an eager ``cp_ops.attention(..., seq_lens=, key_mask=)`` call with ``q``'s shape, after its checks
    (:func:`check_call`): an :class:`EagerPlan`, or None (the general path, on every rank alike: nothing to move,
    ``B * max(seq_lens) * H * D == 0``)."""
    w = pg.size()
    if w == 1:
        return _LocalPlan(pg)
    b, s, h, d = q.shape
    seq = tuple(seq_lens) if seq_lens is not None else (s,) * w
    if b * max(seq) * h * d == 0:
        return None
    return EagerPlan(pg, mode, transport, seq, has_mask, q)


class _LocalPlan:
    """W = 1: :func:`masked_attention` (no exchange, as the general path)."""

    __slots__ = ("pg",)

    def __init__(self, pg):
        self.pg = pg

    def run(self, q, k, v, scale, key_mask=None):
        return masked_attention(q, k, v, scale, key_mask)


def _attend(q, k, v, scale, m4):
    """:func:`masked_attention` with the mask already ``[B, 1, 1, Skv]`` (the same SDPA call; on CUDA the backend
    order of :func:`cp_ops.local_attention` set without the ``sdpa_kernel`` context manager's host cost)."""
    if m4 is None:
        return local_attention(q, k, v, scale)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.is_cuda:
        out = _sdpa_cuda_priority(qt, kt, vt, scale, m4)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m4, scale=scale)
    return out.transpose(1, 2)


class EagerPlan:
    """An eager ``seq_lens`` / ``key_mask`` call of one key (:mod:`cp_ops._eager`): the method of this module with
    everything derivable from (seq_lens, mask shape, W, rank, shapes, dtype, device) computed once — padded shapes,
    the index tensors that select the real rows (on the device) and the rank contract's signature with the
    ``seq_lens`` tag of the ops (:class:`cp_ops.contract.CallCheck`: one exchange per call, named
    'cp_ops::agkv_gather_uneven_start' (AGKV) or 'cp_ops::ulysses_uneven_start' with chunks=1 (Ulysses), the padded
    shape ``[B, max(seq_lens), H, D]``). ``run(q, k, v, scale, key_mask)`` → ``[B, S_local, H, D]``: no input checks,
    no dispatcher, no host sync; the mask's values are read at every call.

    Per call: pad by copying into one fresh buffer (padding rows are never read: only the real rows are selected,
    so they are left unwritten), the transport's launch (the torch transport's all-to-alls called directly, the
    padding written straight into the send buffer), the mask's all-gather (bool), one ``index_select`` per
    selection (AGKV: K and V; Ulysses: Q, K and V together from the received buffer; the output, re-padded, into
    the inverse's send buffer) and ``take`` for the mask; blocks that are all full skip the selection (views)."""

    __slots__ = ("pg", "mode", "resolved", "device", "check", "tr", "epoch", "torch_tr", "direct", "w", "b", "s",
                 "smax", "full", "pad", "kv_idx", "flat_idx", "gather", "gview", "gdim", "gout", "mask_send",
                 "mask_recv", "mask_view", "mask_idx", "heads", "send_shape", "pad3", "qkv_idx", "qkv_shape",
                 "inv_idx", "inv_shape")

    def __init__(self, pg, mode: str, resolved: str, seq: tuple, has_mask: bool, q: torch.Tensor):
        w, dev = pg.size(), q.device
        b, s, h, d = q.shape
        smax, total = max(seq), sum(seq)
        self.pg, self.mode, self.resolved, self.device = pg, mode, resolved, dev
        self.tr, self.epoch, self.torch_tr, self.direct = None, -1, False, False
        self.w, self.b, self.s, self.smax, self.full = w, b, s, smax, all(n == smax for n in seq)
        tag, note = _tag(seq, has_mask)
        op, extra, chunks = (("cp_ops::agkv_gather_uneven_start", 2, 0) if mode == "agkv"
                             else ("cp_ops::ulysses_uneven_start", 3, 1))
        self.check = contract.CallCheck(pg, op, resolved, (b, smax, h, d), q.dtype, extra, chunks, tag, note)
        # token j of the full sequence is row t[j] of rank r[j]'s padded block
        r = torch.repeat_interleave(torch.arange(w), torch.tensor(seq))
        t = torch.arange(total) - torch.tensor(layout.shard_offsets(seq))[r]
        bb = torch.arange(b).view(b, 1)
        self.pad = (b, smax, h, d) if s < smax else None
        # the mask: all-gathered [W*B, smax] bool → [B, 1, 1, total] (SDPA's boolean mask)
        self.mask_send, self.mask_recv = (b, smax), (w * b, smax)
        self.mask_view = (1, 1, 1, w * smax) if b == 1 and self.full else None
        self.mask_idx = None if self.mask_view else ((r * b + bb) * smax + t).view(b, 1, 1, total).to(dev)
        self.kv_idx = self.flat_idx = self.qkv_idx = self.inv_idx = None
        self.heads = self.send_shape = self.pad3 = self.qkv_shape = self.inv_shape = None
        if mode == "agkv":
            # a transport's gather [B, W*smax, H, D] → its real rows (dim 1)
            self.kv_idx = None if self.full else (r * smax + t).to(dev)
            # the torch transport's, called directly: one coalesced all-gather of K, V (and the mask) into
            # [W*B, smax, H, D] (rank-major) → viewed [1, W*smax, H, D] (B = 1: real rows on dim 1) or
            # [W*B*smax, H, D] (B > 1: real rows of each batch row on dim 0, then viewed [B, total, H, D])
            self.gather = (w * b, smax, h, d)
            if b == 1:
                self.gview, self.gdim, self.gout, self.flat_idx = (1, w * smax, h, d), 1, None, self.kv_idx
            else:
                self.gview, self.gdim, self.gout = (w * b * smax, h, d), 0, (b, total, h, d)
                self.flat_idx = ((r * b + bb) * smax + t).reshape(-1).to(dev)
            return
        hl = h // w
        self.heads = (b, s, w, hl, d)
        self.send_shape = (w, b, smax, 3, hl, d)
        self.pad3 = (3, b, smax, h, d) if s < smax else None
        if not self.full:
            # rows of the received [W, B, smax, 3, Hl, D] as [W*B*smax*3, Hl, D] → [3, B, total, Hl, D]
            i3 = torch.arange(3).view(3, 1, 1)
            self.qkv_idx = (((r * b + bb) * smax + t) * 3 + i3).reshape(-1).to(dev)
            self.qkv_shape = (3, b, total, hl, d)
            # the inverse's send rows: position p = r*smax + u of [W*smax] ← output row offset[r] + u (u < seq[r]),
            # any row (0) in the padding
            p = torch.arange(w * smax)
            rp, u = p // smax, p % smax
            n = torch.tensor(seq)[rp]
            self.inv_idx = torch.where(u < n, torch.tensor(layout.shard_offsets(seq))[rp] + u, 0).to(dev)
            self.inv_shape = (w, smax, b, hl, d)

    def run(self, q, k, v, scale, key_mask=None):
        self.check.check()  # the rank contract: before any data moves
        if self.epoch != transport_base.epoch:  # first call, or the transports' per-group choices were reset
            self.tr = transport_base.for_group(self.resolved, self.pg, self.device)
            self.torch_tr, self.epoch = self.tr.name == "torch", transport_base.epoch
            # AGKV: the torch transport's gather, called directly (one launch with the mask), but for full blocks
            # and B > 1, where the transport's per-row gather needs no selection (no copy)
            self.direct = self.torch_tr and (self.b == 1 or not self.full)
        if self.mode == "agkv":
            return self._agkv(q, k, v, scale, key_mask)
        return self._ulysses(q, k, v, scale, key_mask)

    def _mask_buffers(self, key_mask):
        """(send [B, smax], receive [W*B, smax]) bool buffers of the mask's all-gather."""
        s = self.s
        if s == self.smax:
            send = key_mask.contiguous()
        else:
            send = key_mask.new_empty(self.mask_send)
            send.narrow(1, 0, s).copy_(key_mask)
        return send, key_mask.new_empty(self.mask_recv)

    def _mask_real(self, recv):
        """The gathered ``[W*B, smax]`` mask → SDPA's ``[B, 1, 1, total]`` (the real keys)."""
        return recv.view(self.mask_view) if self.mask_view else recv.take(self.mask_idx)

    def _mask_start(self, key_mask):
        send, recv = self._mask_buffers(key_mask)
        return recv, self.pg._allgather_base(recv, send)

    def _mask_wait(self, recv, work):
        work.wait()
        return self._mask_real(recv)

    def _agkv(self, q, k, v, scale, key_mask):
        if self.pad is not None:
            s = self.s
            ks, vs = k.new_empty(self.pad), v.new_empty(self.pad)
            ks.narrow(1, 0, s).copy_(k)
            vs.narrow(1, 0, s).copy_(v)
        else:
            ks, vs = k.contiguous(), v.contiguous()
        if self.direct:
            kr, vr = ks.new_empty(self.gather), vs.new_empty(self.gather)
            if key_mask is None:
                self.pg.allgather_into_tensor_coalesced([kr, vr], [ks, vs]).wait()
                m4 = None
            else:
                ms, mr = self._mask_buffers(key_mask)
                self.pg.allgather_into_tensor_coalesced([kr, vr, mr], [ks, vs, ms]).wait()
                m4 = self._mask_real(mr)
            kf, vf = kr.view(self.gview), vr.view(self.gview)
            if self.flat_idx is not None:
                kf, vf = kf.index_select(self.gdim, self.flat_idx), vf.index_select(self.gdim, self.flat_idx)
                if self.gout is not None:
                    kf, vf = kf.view(self.gout), vf.view(self.gout)
            return _attend(q, kf, vf, scale, m4)
        kf, vf, work = self.tr.agkv_start(ks, vs, self.pg)
        m = None if key_mask is None else self._mask_start(key_mask)
        work.wait()
        if self.kv_idx is not None:
            kf, vf = kf.index_select(1, self.kv_idx), vf.index_select(1, self.kv_idx)
        return _attend(q, kf, vf, scale, None if m is None else self._mask_wait(*m))

    def _ulysses(self, q, k, v, scale, key_mask):
        s, smax, pg = self.s, self.smax, self.pg
        if self.torch_tr:  # pad and pack in one copy into the all-to-all's send buffer
            send = q.new_empty(self.send_shape)
            dst = send.narrow(2, 0, s).unbind(3) if s < smax else send.unbind(3)
            for x, to in zip((q, k, v), dst):
                to.copy_(x.reshape(self.heads).permute(2, 0, 1, 3, 4))
            buf = torch.empty_like(send)
            work = pg.alltoall_base(buf, send, [], [])
        else:
            if self.pad3 is not None:
                padded = q.new_empty(self.pad3)
                for x, to in zip((q, k, v), padded.narrow(2, 0, s).unbind(0)):
                    to.copy_(x)
                xs = list(padded.unbind(0))
            else:
                xs = [q, k, v]
            buf, work = self.tr.ulysses_start(xs, pg)
        m = None if key_mask is None else self._mask_start(key_mask)
        work.wait()
        if self.qkv_idx is None:
            qh, kh, vh = (layout.ulysses_unpack(buf, i) for i in range(3))
        else:
            hl, d = self.qkv_shape[3:]
            qh, kh, vh = buf.view(-1, hl, d).index_select(0, self.qkv_idx).view(self.qkv_shape).unbind(0)
        out = _attend(qh, kh, vh, scale, None if m is None else self._mask_wait(*m))  # [B, total, Hl, D]
        if self.inv_idx is None:
            back, work = self.tr.ulysses_inverse_start(out, pg)
            work.wait()
            return layout.ulysses_inverse_unpack(back)
        if self.torch_tr:  # the re-padded output straight into the send buffer, laid out [W, smax, B, Hl, D]
            send = out.transpose(0, 1).index_select(0, self.inv_idx)
            back = torch.empty_like(send)
            pg.alltoall_base(back, send, [], []).wait()
            back = back.view(self.inv_shape)
            if s < smax:
                back = back.narrow(1, 0, s)
            b, _, w, hl, d = self.heads
            return back.permute(2, 1, 0, 3, 4).clone(memory_format=torch.contiguous_format).view(b, s, w * hl, d)
        back, work = self.tr.ulysses_inverse_start(out.index_select(1, self.inv_idx), pg)
        work.wait()
        return inverse_rows(back, s)
