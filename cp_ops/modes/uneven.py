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
given)`` into the rank contract's per-call signature (:func:`cp_ops.validate.exchange`'s ``tag``): ranks that
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
from .. import layout, validate
from .._hooks import run_compile_hooks
from ..attention import _CUDA_PRIORITY, local_attention

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
    CUDA the backends in :func:`cp_ops.local_attention`'s order (one that cannot take a mask is skipped)."""
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
        validate.exchange(pg, op, transport, None, extra, failed=e, tag=tag, note=note)
        raise
    t = make_t()
    validate.exchange(pg, op, transport, t, extra, tag=tag, note=note)
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
    validate.register_op(_op._qualname)

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
