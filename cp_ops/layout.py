"""Token/head layouts of the CP collectives, as pure view/copy functions (traceable by torch.compile).

Shapes (W = CP world size, n = tensors sent together, Hl = H / W heads per rank after Ulysses):

- AGKV output: ``[B, W * S_local, H, D]`` — tokens in rank order, what attention reads; written in place.
- Ulysses buffer (sequence → heads): ``[W, B, S_local, n, Hl, D]``; index 0 is the *source rank*, i.e. the
  token block. Slot ``i`` as ``[B, S, Hl, D]`` is a view for B = 1 (no copy after the all-to-all).
- Ulysses inverse buffer (heads → sequence): ``[W, B, S_local, Hl, D]``; index 0 is the source rank, i.e.
  the head group; back to ``[B, S_local, H, D]`` is one permute copy, always (never a view of the buffer,
  which a transport may pool).

Method: DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509).
"""

from __future__ import annotations

import torch


def ulysses_pack(xs: list[torch.Tensor], world_size: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Send buffer ``[W, B, S_local, n, Hl, D]`` (contiguous) from n tensors ``[B, S_local, H, D]`` (any strides);
    slab w holds head group w. One ``torch.stack`` of the n tensors seen as ``[W, B, S_local, Hl, D]`` (one
    ``as_strided`` view each): n + 1 calls, one allocation, the copies issued from C++.

    ``lo``/``hi``: only heads ``[lo, hi)`` of every head group (pipelined Ulysses' sub-groups): the buffer is
    ``[W, B, S_local, n, hi - lo, D]``, what packing ``x[:, :, w*Hl + lo : w*Hl + hi]`` (over w) would give, without
    that intermediate copy."""
    b, s, h, d = xs[0].shape
    hl = h // world_size
    hi = hl if hi is None else hi
    views = []
    for x in xs:
        sb, ss, sh, sd = x.stride()
        views.append(x.as_strided((world_size, b, s, hi - lo, d), (hl * sh, sb, ss, sh, sd),
                                  x.storage_offset() + lo * sh))
    return torch.stack(views, dim=3)


def ulysses_unpack(buf: torch.Tensor, i: int) -> torch.Tensor:
    """Slot ``i`` of a received Ulysses buffer as ``[B, S, Hl, D]`` (a strided view when B = 1).

    Compiled code reads the slots this way (``select(buf, 3, i)``: the overlap pass looks for it); eager code
    reads all of them at once with :func:`ulysses_unpack_all`."""
    w, b, s, _, hl, d = buf.shape
    return buf[:, :, :, i].permute(1, 0, 2, 3, 4).reshape(b, w * s, hl, d)


def ulysses_unpack_all(buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every slot of a received Ulysses buffer ``[W, B, S_local, n, Hl, D]``: n tensors ``[B, W*S_local, Hl, D]``,
    each equal to :func:`ulysses_unpack` ``(buf, i)`` with the same strides, in three calls instead of 3n.

    B = 1: strided views of ``buf`` (no copy). B > 1: one copy of all n slots into one contiguous
    ``[n, B, W*S_local, Hl, D]`` tensor whose slices are returned, when each slice starts 256-byte aligned (as a
    fresh allocation does, so an attention kernel picks the same algorithm); else one copy per slot."""
    w, b, s, n, hl, d = buf.shape
    if b == 1 or (b * w * s * hl * d * buf.element_size()) % 256 == 0:
        return buf.permute(3, 1, 0, 2, 4, 5).reshape(n, b, w * s, hl, d).unbind(0)
    return tuple(ulysses_unpack(buf, i) for i in range(n))


def ulysses_inverse_pack(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Send buffer ``[W, B, S_local, Hl, D]`` from ``[B, S, Hl, D]``; slab w holds token block w."""
    b, s, hl, d = x.shape
    return x.reshape(b, world_size, s // world_size, hl, d).transpose(0, 1).contiguous()


def ulysses_inverse_unpack(buf: torch.Tensor) -> torch.Tensor:
    """``[W, B, S_local, Hl, D]`` (slab w = head group w) → ``[B, S_local, W * Hl, D]``, a new tensor.

    One copy in every case, as before: ``reshape`` copied the permuted buffer anyway, except when
    B·S_local = 1, where it returned a view of ``buf`` (a pooled receive slot under the fast transport).
    """
    w, b, s, hl, d = buf.shape
    return buf.permute(1, 2, 0, 3, 4).clone(memory_format=torch.contiguous_format).view(b, s, w * hl, d)


# ---- uneven shards (cp_ops.modes.uneven) ---------------------------------------------------------
def shard_sizes(total: int, world_size: int) -> tuple[int, ...]:
    """The standard split of ``total`` tokens over W ranks: ``torch.tensor_split``'s rule — the first
    ``total % W`` ranks hold one token more (e.g. 7 tokens on W = 2 → ``(4, 3)``; 8423 on W = 3 →
    ``(2808, 2808, 2807)``). Branch-free, so a symbolic ``total`` (``torch.compile(dynamic=True)``) stays symbolic.

    Raises:
        ValueError: ``world_size`` < 1 or ``total`` < 0.
    """
    if isinstance(world_size, int) and world_size < 1:
        raise ValueError(f"shard_sizes: world_size must be >= 1; got {world_size}")
    if isinstance(total, int) and total < 0:
        raise ValueError(f"shard_sizes: total must be >= 0 tokens; got {total}")
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
