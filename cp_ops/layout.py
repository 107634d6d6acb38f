"""Token/head layouts of the CP collectives, as pure view/copy functions (traceable by torch.compile).

W = CP world size, n = tensors sent together, Hl = H / W heads per rank after Ulysses. AGKV output:
``[B, W * S_local, H, D]``, tokens in rank order. Ulysses buffer (sequence → heads): ``[W, B, S_local, n, Hl, D]``,
dim 0 the source rank (token block); slot ``i`` as ``[B, S, Hl, D]`` is a view for B = 1. Inverse buffer (heads →
sequence): ``[W, B, S_local, Hl, D]``, dim 0 the head group; unpacked by one permute copy (never a view of the buffer,
which a transport may pool). Method: DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509).
"""

from __future__ import annotations

import torch


#: More heads than the DiTs we know have (Wan 14B: 40): a 'bshd' tensor whose dim 2 holds more, and more than its
#: dim 1, is taken for BHSD.
MAX_HEADS = 64


def check_not_bhsd(name: str, t) -> None:
    """Raise ValueError when ``t``, passed as BSHD, is a BHSD tensor by :func:`cp_ops.attention`'s ``layout`` rule."""
    if isinstance(t, torch.Tensor) and t.dim() == 4:
        s, h = t.shape[1], t.shape[2]
        if isinstance(s, int) and isinstance(h, int) and h > MAX_HEADS and h > s:
            raise ValueError(
                f"{name} has shape {list(t.shape)}: read as [B, S_local, H, D] (layout='bshd', the default) that is "
                f"{h} heads and {s} tokens, more heads than any DiT has; it looks like [B, H, S, D] (layout='bhsd', "
                "SDPA's layout): pass layout='bhsd', or transpose it with .transpose(1, 2)")


#: integer dtypes a layout copy may move its rows as, widest first, with their sizes (see :func:`wide`)
_WIDE = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


def wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` seen as the widest integer dtype its rows allow (the same bytes, a shorter last dim; ``x`` itself when
    none is wider, under torch.compile, or when ``x`` requires grad: an integer view would cut the autograd graph).
    Why: a strided copy (Ulysses' pack and unpack) runs one element per lane; as int64 a bf16 row is 4x fewer
    elements (1.9-2.3x faster on an H200, ``benchmarks/results/bound/runs/2026-12-01e_pack_ab.json``). The rule is
    ``Tensor.view(dtype)``'s; about 1-2 µs of host time per call."""
    if torch.compiler.is_compiling():
        return x
    return _wide(x)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """:func:`wide` in code that is never traced (a transport's launch packing its send buffer)."""
    if x.requires_grad:
        return x
    shape, stride, size = x.shape, x.stride(), x.element_size()
    if not shape or size >= 8 or (stride[-1] != 1 and shape[-1] != 1):
        return x
    offset = x.storage_offset()
    outer = [st for n, st in zip(shape[:-1], stride[:-1]) if n != 1]  # the strides a wider view must keep whole
    for dt, width in _WIDE:
        r = width // size
        if r < 2:
            break
        if shape[-1] % r or offset % r:
            continue
        for st in outer:
            if st % r:
                break
        else:
            try:
                return x.view(dt)
            except RuntimeError:  # a size-1 dim's stride torch's rule still checks: keep the narrow dtype
                continue
    return x


def ulysses_pack(xs: list[torch.Tensor], world_size: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Send buffer ``[W, B, S_local, n, hi - lo, D]`` (contiguous; slab w holds head group w) from n tensors
    ``[B, S_local, H, D]`` (any strides): one ``torch.stack`` of ``as_strided`` views, rows moved as :func:`wide`.
    ``lo``/``hi``: only heads ``[lo, hi)`` of every head group (pipelined Ulysses' sub-groups; default: all)."""
    b, s, h, _ = xs[0].shape
    hl = h // world_size
    hi = hl if hi is None else hi
    ws = list(map(_wide, xs))  # (run by a launch, never traced)
    for t in ws:
        if t.dtype != ws[0].dtype:  # not all widened alike: pack in the inputs' own dtype
            ws = xs
            break
    views = []
    for x in ws:
        sb, ss, sh, sd = x.stride()
        views.append(x.as_strided((world_size, b, s, hi - lo, x.shape[3]), (hl * sh, sb, ss, sh, sd),
                                  x.storage_offset() + lo * sh))
    out = torch.stack(views, dim=3)
    return out if out.dtype == xs[0].dtype else out.view(xs[0].dtype)


def ulysses_pack_traced(xs: list[torch.Tensor], world_size: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """:func:`ulysses_pack` as plain torch views and one stack, bitwise equal, for a compiler: Inductor lowers the
    stack into the kernels producing the inputs (their norm + RoPE write the send buffer directly); an
    ``as_strided`` would make it write the inputs out first."""
    b, s, h, d = xs[0].shape
    hl = h // world_size
    hi = hl if hi is None else hi
    views = []
    for x in xs:
        v = x.reshape(b, s, world_size, hl, d)
        if lo != 0 or hi != hl:
            v = v[:, :, :, lo:hi]
        views.append(v.permute(2, 0, 1, 3, 4))
    return torch.stack(views, dim=3)


def ulysses_unpack(buf: torch.Tensor, i: int) -> torch.Tensor:
    """Slot ``i`` of a received Ulysses buffer as ``[B, S, Hl, D]`` (a strided view when B = 1); compiled code reads
    the slots this way (``select(buf, 3, i)``: the overlap pass looks for it)."""
    w, b, s, _, hl, d = buf.shape
    return buf[:, :, :, i].permute(1, 0, 2, 3, 4).reshape(b, w * s, hl, d)


def ulysses_unpack_all(buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every slot of a received Ulysses buffer: n tensors ``[B, W*S_local, Hl, D]``, as :func:`ulysses_unpack`
    ``(buf, i)`` with the same strides. B = 1: views; B > 1: one copy of all n slots when each slice starts 256-byte
    aligned (as a fresh allocation, so attention picks the same algorithm), else one copy per slot."""
    w, b, s, n, hl, d = buf.shape
    if b == 1 or (b * w * s * hl * d * buf.element_size()) % 256 == 0:
        return buf.permute(3, 1, 0, 2, 4, 5).reshape(n, b, w * s, hl, d).unbind(0)
    return tuple(ulysses_unpack(buf, i) for i in range(n))


def ulysses_heads(x: torch.Tensor, world_size: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """``[B, S, H, D]`` → ``[B, S, W*(hi-lo), D]``: heads ``[lo, hi)`` of every rank's head group (pipelined Ulysses'
    sub-group; a copy), or ``x`` itself when that is every head."""
    b, s, h, d = x.shape
    hl = h // world_size
    hi = hl if hi is None else hi
    if lo == 0 and hi == hl:
        return x
    return x.reshape(b, s, world_size, hl, d)[:, :, :, lo:hi].reshape(b, s, world_size * (hi - lo), d)


def ulysses_inverse_pack(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Send buffer ``[W, B, S_local, Hl, D]`` from ``[B, S, Hl, D]``; slab w holds token block w."""
    b, s, hl, _ = x.shape
    y = _wide(x)  # the rows moved as wide integers where they allow it (the same bytes; run by a launch, never traced)
    out = y.reshape(b, world_size, s // world_size, hl, y.shape[3]).transpose(0, 1).contiguous()
    return out if out.dtype == x.dtype else out.view(x.dtype)


def ulysses_inverse_unpack(buf: torch.Tensor) -> torch.Tensor:
    """``[W, B, S_local, Hl, D]`` (slab w = head group w) → ``[B, S_local, W * Hl, D]``, a new tensor (never a view
    of ``buf``, which a transport may pool) — except the FP8 decode's output (its permute contiguous): that view."""
    w, b, s, hl, _ = buf.shape
    p = buf.permute(1, 2, 0, 3, 4)
    if p.is_contiguous() and not buf.is_contiguous():
        return p.view(b, s, w * hl, buf.shape[4])
    y = wide(buf)
    out = y.permute(1, 2, 0, 3, 4).clone(memory_format=torch.contiguous_format).view(b, s, w * hl, y.shape[4])
    return out if out.dtype == buf.dtype else out.view(buf.dtype)


# ---- uneven shards: helpers of Shards (below) ---------------------------------------------------------
def shard_sizes(total: int, world_size: int) -> tuple[int, ...]:
    """The standard split of ``total`` tokens over W ranks, the **prefix split**: every rank holds
    ``smax = ceil(total / W)`` tokens except the last, which holds the rest (10 on W = 4 → ``(3, 3, 3, 1)``). Where
    that would leave a rank empty while another holds two or more (e.g. 9 on W = 4), ``torch.tensor_split``'s rule
    (``(3, 2, 2, 2)``); fewer tokens than ranks: one each, then empty ranks. Why: under a prefix split the real rows
    of the padded blocks are their first ``total`` (a view, :attr:`Shards.prefix`); short blocks in the middle cost
    copies (+1.5 ms of FLUX.1-dev's 39.5 ms forward at 1008² on W = 4, an H200).

    Raises:
        ValueError: ``world_size`` < 1 or ``total`` < 0.
    """
    if isinstance(world_size, int) and world_size < 1:
        raise ValueError(f"shard_sizes: world_size must be >= 1; got {world_size}")
    if isinstance(total, int) and total < 0:
        raise ValueError(f"shard_sizes: total must be >= 0 tokens; got {total}")
    smax = (total + world_size - 1) // world_size
    last = total - (world_size - 1) * smax
    if last >= 1:  # (a symbolic total: a guard on this condition, its value stays symbolic)
        return (smax,) * (world_size - 1) + (last,)
    if total < world_size:  # one token each, then empty ranks (both rules)
        return tuple(1 if r < total else 0 for r in range(world_size))
    return tuple((total + world_size - 1 - r) // world_size for r in range(world_size))


def shard_offsets(seq_lens) -> tuple[int, ...]:
    """Where each rank's block starts in the full sequence: ``(0, n0, n0 + n1, ...)`` (W entries)."""
    out, acc = [], 0
    for n in seq_lens:
        out.append(acc)
        acc = acc + n
    return tuple(out)


def shard(x: torch.Tensor, dim: int, rank: int, world_size: int, seq_lens=None) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (a view, ``x.narrow``): rank ``rank`` of ``world_size`` under
    :func:`shard_sizes` (or under ``seq_lens``, W token counts summing to ``x.shape[dim]``, if given).

    Raises:
        ValueError: ``rank`` not in ``[0, W)``; ``seq_lens`` not W counts summing to ``x.shape[dim]``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"shard: rank must be in [0, world_size={world_size}); got {rank}")
    sizes = shard_sizes(x.shape[dim], world_size) if seq_lens is None else tuple(seq_lens)
    if len(sizes) != world_size or sum(sizes) != x.shape[dim]:
        raise ValueError(f"shard: seq_lens must be {world_size} token counts summing to x.shape[{dim}]="
                         f"{x.shape[dim]}; got {list(sizes)}")
    return x.narrow(dim, shard_offsets(sizes)[rank], sizes[rank])


# ---- uneven shards and key-padding masks: a layout every mode body takes ----------------------------
def check_seq_lens(seq_lens, world_size: int, rank: int | None = None, s_local: int | None = None,
                   total: int | None = None) -> None:
    """``seq_lens`` must be W non-negative ints (rank order); ``seq_lens[rank] == s_local`` and
    ``sum(seq_lens) == total`` where given. Raises ValueError naming the rule and the values seen."""
    from .validate import _require

    if not isinstance(seq_lens, (tuple, list)):
        raise ValueError(f"seq_lens must be a tuple of {world_size} token counts (one per rank of the CP group, in "
                         f"rank order) or None; got {type(seq_lens).__name__} {seq_lens!r}")
    if len(seq_lens) != world_size:
        raise ValueError(f"seq_lens must have one token count per rank of the CP group (world_size={world_size}); "
                         f"got {len(seq_lens)}: {list(seq_lens)}")
    for n in seq_lens:
        if isinstance(n, bool) or not isinstance(n, (int, torch.SymInt)):
            raise ValueError(f"seq_lens must hold ints; got {type(n).__name__} {n!r} in {list(seq_lens)}")
        _require(n >= 0, lambda: f"seq_lens must be non-negative token counts; got {list(seq_lens)}")
    if rank is not None and s_local is not None:
        _require(seq_lens[rank] == s_local, lambda: (
            f"seq_lens[rank] must equal this rank's local token count (q.shape[1]); got seq_lens={list(seq_lens)}, "
            f"rank={rank}, S_local={s_local}"))
    if total is not None:
        _require(sum(seq_lens) == total, lambda: (
            f"sum(seq_lens) must equal the full sequence length x.shape[1]; got seq_lens={list(seq_lens)} "
            f"(sum {sum(seq_lens)}), x.shape[1]={total}"))


def every_key(key_mask, s_local, total, seq_lens=None) -> bool:
    """Whether ``key_mask`` (``[B, n]``) holds every key of the call (``n = total``) rather than this rank's
    (``n = S_local``). When one rank holds every token, every rank's mask is read as its own (a rank holding none
    passing ``[B, 0]`` or ``[B, total]``: its block of it), so all ranks agree."""
    if key_mask.shape[1] != total or total == s_local:
        return False
    return seq_lens is None or total not in tuple(seq_lens)


def check_key_mask(key_mask, x: torch.Tensor, total=None) -> None:
    """``key_mask``: bool ``[B, S_local]`` on ``x``'s device (given ``total``: ``[B, total]``, keys in rank order)."""
    from .validate import _require

    if not isinstance(key_mask, torch.Tensor):
        raise ValueError(f"key_mask must be a bool tensor [B, S_local] (True = attend this key, False = padding) or "
                         f"None; got {type(key_mask).__name__}")
    if key_mask.dtype != torch.bool:
        kind = "additive float masks are not supported; " if key_mask.is_floating_point() else ""
        raise ValueError(f"key_mask must be a bool key-padding mask (True = attend, False = padding): pass a bool mask "
                         f"(for a 0/1 mask: mask > 0); {kind}got dtype {key_mask.dtype}")
    b, s = x.shape[0], x.shape[1]
    every = "" if total is None else f", or [B, S_total] = [{b}, {total}] (every key of the call, in rank order)"
    _require(key_mask.dim() == 2 and key_mask.shape[0] == b and (
        key_mask.shape[1] == s or (total is not None and key_mask.shape[1] == total)), lambda: (
        f"key_mask must be [B, S_local] = [{b}, {s}] (one flag per key of this rank, the same for every query and "
        f"head; per-query and per-head masks are not supported){every}; got shape {tuple(key_mask.shape)}"))
    if key_mask.device != x.device:
        raise ValueError(f"key_mask must be on the device of q/k/v ({x.device}); got {key_mask.device}")


def s_max(seq_lens):
    """``max(seq_lens)``: ``torch.sym_max`` where a count is symbolic (no guard), plain ``max`` for ints (Dynamo
    refuses a ``torch.sym_max`` that returns an int)."""
    m = seq_lens[0]
    for n in seq_lens[1:]:
        m = max(m, n) if isinstance(m, int) and isinstance(n, int) else torch.sym_max(m, n)
    return m


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, S, ...]`` → ``[B, S + n, ...]``: x's rows, then n rows of zeros (False for bool), one ``pad``."""
    return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, n))


class Shards:
    """Uneven shards and/or a key-padding mask of one CP attention call: the layout a mode body moves and selects.

    ``seq_lens``: W token counts in rank order, the same on every rank (any split, 0 allowed; None: every rank holds
    ``s_local``); ``total = sum(seq_lens)``. ``key_mask`` (per call): bool ``[B, S_local]``, True = attend; it travels
    with its rank's keys and is applied as SDPA's boolean mask over the full key sequence.

    Every rank pads its block to ``smax = max(seq_lens)`` rows and the transports move the padded blocks evenly.
    Without a key mask the receiver takes the real rows before attention (bitwise equal to one device): under a
    **prefix** split (:attr:`prefix`, as :func:`shard_sizes` splits) the first ``total`` rows, a view (the output
    re-padded by one zero ``pad``); else one ``index_select`` (traced: a ``cat`` of slices), the output re-padded by
    the inverse selection. With a key mask nothing is selected: the padding rows are zeros attended with the mask False
    (:meth:`padded_mask`), equal to one device up to the order of the kernel's sums. Full blocks skip both.
    """

    def __init__(self, seq_lens, world: int, rank: int, s_local: int, device):
        seq = tuple(seq_lens) if seq_lens is not None else (s_local,) * world
        self.seq, self.world, self.rank, self.s_local = seq, world, rank, s_local
        self.smax = s_max(seq)
        self.total = sum(seq)
        self.full = all(n == self.smax for n in seq)
        #: every block before the last non-empty one is full: the real rows are the first ``total``
        self.prefix, short = True, False
        for n in seq:  # (a loop: Dynamo traces it)
            self.prefix = self.prefix and not (short and n != 0)
            short = short or n != self.smax
        self.device = device
        self._kv = self._inv = None

    def kv_index(self) -> torch.Tensor:
        """Row of ``[W*smax]`` (padded blocks in rank order) for each of the ``total`` real tokens."""
        if self._kv is None:
            r = torch.repeat_interleave(torch.arange(self.world), torch.tensor(self.seq))
            t = torch.arange(self.total) - torch.tensor(shard_offsets(self.seq))[r]
            self._kv = (r * self.smax + t).to(self.device)
        return self._kv

    def inverse_index(self) -> torch.Tensor:
        """For each row ``p = r*smax + u`` of the re-padded ``[W*smax]``: the real row ``offset[r] + u`` (u < seq[r]),
        any row (0) in the padding."""
        if self._inv is None:
            w, smax = self.world, self.smax
            p = torch.arange(w * smax)
            rp, u = p // smax, p % smax
            n = torch.tensor(self.seq)[rp]
            self._inv = torch.where(u < n, torch.tensor(shard_offsets(self.seq))[rp] + u, 0).to(self.device)
        return self._inv

    def pad(self, x: torch.Tensor, zero: bool = False) -> torch.Tensor:
        """``[B, S_local, ...]`` → ``[B, smax, ...]``: a fresh contiguous buffer with x's rows first, the padding rows
        unwritten (never read), or zeros with ``zero`` (attended, masked). Traced: a zero ``pad`` (the compiler
        writes it with its consumer)."""
        if self.s_local == self.smax:
            return x.contiguous()
        if torch.compiler.is_compiling():
            return _pad_rows(x, self.smax - self.s_local)
        out = x.new_empty((x.shape[0], self.smax, *x.shape[2:]))
        out.narrow(1, 0, self.s_local).copy_(x)
        if zero:
            out.narrow(1, self.s_local, self.smax - self.s_local).zero_()
        return out

    def pad_mask(self, key_mask: torch.Tensor) -> torch.Tensor:
        """bool ``[B, S_local]`` → uint8 ``[B, smax]`` (padding rows 0); ``[B, total]``: this rank's block of it."""
        if key_mask.shape[1] != self.s_local:
            key_mask = key_mask.narrow(1, sum(self.seq[:self.rank]), self.s_local)
        return self.pad(key_mask.to(torch.uint8), zero=True)

    def rows(self, full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``[.., W*smax, ..]`` (padded blocks along ``dim``) → ``[.., total, ..]``: the real rows (a view where every
        block is full or the split a prefix; else ``index_select``, traced a ``cat`` of slices: no index constant)."""
        if self.full:
            return full
        if self.prefix:
            return full.narrow(dim, 0, self.total)
        if torch.compiler.is_compiling():
            return torch.cat([full.narrow(dim, r * self.smax, n) for r, n in enumerate(self.seq)], dim=dim)
        return full.index_select(dim, self.kv_index())

    def every_key(self, key_mask: torch.Tensor) -> bool:
        """Whether ``key_mask`` is the call's every-key mask ``[B, total]`` (:func:`every_key`), not this rank's."""
        return every_key(key_mask, self.s_local, self.total, self.seq)

    def padded_mask(self, key_mask: torch.Tensor, gathered: torch.Tensor | None, batch: int) -> torch.Tensor:
        """SDPA's bool ``[B, 1, 1, W*smax]`` over the padded blocks: the call's key mask, every padding row False.
        ``gathered``: the padded masks gathered (``[W*B, smax]`` uint8, rank-major), or None for an every-key mask
        ``[B, total]``, re-padded here."""
        if gathered is None:
            m = key_mask if self.full else self._repad_blocks(key_mask)
        else:
            m = gathered.view(self.world, batch, self.smax).transpose(0, 1).reshape(batch, self.world * self.smax) != 0
        return m.reshape(batch, 1, 1, self.world * self.smax)

    def attend_padded(self, key_mask: torch.Tensor, comm, batch: int) -> torch.Tensor:
        """:meth:`padded_mask` of a call's key mask: an every-key mask as given, else gathered (waited at once)."""
        gathered = None if self.every_key(key_mask) else comm.mask(self.pad_mask(key_mask)).wait()
        return self.padded_mask(key_mask, gathered, batch)

    def mask(self, gathered: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        """A gathered mask ``[W*B, smax]`` uint8 (rank-major) → SDPA's bool ``[B, 1, 1, total]`` (real keys)."""
        if gathered is None:
            return None
        m = gathered.view(self.world, batch, self.smax).transpose(0, 1).reshape(batch, self.world * self.smax)
        return (self.rows(m) != 0).view(batch, 1, 1, self.total)

    def ulysses_rows(self, buf: torch.Tensor, unpack) -> tuple[torch.Tensor, ...]:
        """A received Ulysses buffer ``[W, B, smax, n, Hl, D]`` → n tensors ``[B, total, Hl, D]``, the real rows: views
        (full or prefix); traced, per slot (the ``select(buf, 3, i)`` the overlap pass splits by); else one copy."""
        if self.full:
            return tuple(unpack(buf))
        if self.prefix or torch.compiler.is_compiling():
            return tuple(self.rows(t, 1) for t in unpack(buf))
        w, b, smax, n, hl, d = buf.shape
        return self.rows(buf.permute(3, 1, 0, 2, 4, 5).reshape(n, b, w * smax, hl, d), 2).unbind(0)

    def repad(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, total, Hl, D]`` → ``[B, W*smax, Hl, D]``, block r at ``r*smax``, padding unread: the inverse's send."""
        if self.full:
            return out
        if self.prefix or torch.compiler.is_compiling():
            return self._repad_blocks(out)
        return out.index_select(1, self.inverse_index())

    def _repad_blocks(self, out: torch.Tensor) -> torch.Tensor:
        """:meth:`repad` by slices and zero pads, no index tensor (traced code; an every-key mask, eager too). A prefix
        split is one ``pad``; tensor_split's split (k blocks of ``smax``, then ``smax - 1``) the full blocks and the
        short ones padded by one ``pad`` (one or two kernels); any other split a ``cat`` of up to 2W - 1 parts (past
        Inductor's ``max_pointwise_cat_inputs``, 8: one copy kernel per part)."""
        w, smax, seq = self.world, self.smax, self.seq
        if self.prefix:  # the real rows first, the padding after them
            return _pad_rows(out, w * smax - self.total)
        k = sum(1 for n in seq if n == smax)
        if smax > 1 and k < w and seq == (smax,) * k + (smax - 1,) * (w - k):
            rest = out.shape[2:]
            head = out.narrow(1, 0, k * smax)
            tail = out.narrow(1, k * smax, (w - k) * (smax - 1)).unflatten(1, (w - k, smax - 1))
            tail = torch.nn.functional.pad(tail, (0, 0) * len(rest) + (0, 1)).flatten(1, 2)
            return torch.cat([head, tail], dim=1) if k else tail
        parts, off = [], 0
        for n in seq:
            parts.append(out.narrow(1, off, n))
            if n < smax:
                parts.append(out.new_zeros(out.shape[0], smax - n, *out.shape[2:]))
            off += n
        return torch.cat(parts, dim=1)

    def inverse_rows(self, back: torch.Tensor) -> torch.Tensor:
        """A received inverse buffer ``[W, B, smax, Hl, D]`` → this rank's ``[B, S_local, W*Hl, D]`` (a new tensor)."""
        if self.s_local == self.smax:
            return ulysses_inverse_unpack(back)
        w, b, smax, hl, d = back.shape
        return back[:, :, :self.s_local].permute(1, 2, 0, 3, 4).clone(memory_format=torch.contiguous_format).view(
            b, self.s_local, w * hl, d)

    def block(self, src: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of ``[W*smax]`` that hold rank ``src``'s real tokens."""
        return src * self.smax, src * self.smax + self.seq[src]
