"""Reference DiT attention blocks (BSHD, context-parallel attention): the one copy used by the overlap-pass
tests (``tests/test_pass_*.py``) and the overlap benchmark (``benchmarks/overlap_block.py``).

Blocks (all take the local token shard ``x [B, S_local, dim]`` and RoPE tables ``cos, sin [S_local, D]``):
    WanBlock        Q/K/V projections, RMSNorm over all heads (dim) on q and k, 3-D RoPE, attention, output proj.
    FluxBlock       Z-Image/Flux style: per-head RMSNorm (head_dim), joint text + image tokens (concatenated).
    FusedQKVBlock   one fused QKV GEMM, then split, norms, RoPE.
    Stack           several WanBlocks with residuals: several windows in one graph.
``cp=False`` replaces CP attention with single-device attention (no cp ops in the graph); ``attention=f``
replaces it with ``f(q, k, v)`` (the benchmark's compute-only stand-in); ``transport`` is passed to
:func:`cp_ops.attention`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import cp_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(grid: tuple[int, int, int], head_dim: int, offset: int = 0, count: int | None = None, theta: float = 10000.0):
    """3-D RoPE (frames, height, width): ``cos, sin [count, head_dim]`` (fp32) for tokens ``offset..offset+count``
    of a frame-major token grid (``count=None``: to the end of ``grid``; the frame axis may run past ``grid[0]``).

    head_dim is split over the three axes (as Wan does: the frame axis gets the remainder), pairs interleaved.
    """
    f, h, w = grid
    count = f * h * w - offset if count is None else count
    idx = torch.arange(offset, offset + count)
    pos = torch.stack((idx // (h * w), (idx // w) % h, idx % w), -1)
    d_h = d_w = 2 * (head_dim // 6)
    d_f = head_dim - d_h - d_w
    angles = []
    for axis, d in enumerate((d_f, d_h, d_w)):
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles.append(pos[:, axis, None].double() * inv)
    ang = torch.cat(angles, -1).repeat_interleave(2, -1)  # [count, head_dim]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, S, H, D]``; cos/sin ``[S, D]``; rotate interleaved pairs (x0, x1) → (x0 c - x1 s, x1 c + x0 s)."""
    x1 = x.float().unflatten(-1, (-1, 2))
    rot = torch.stack((-x1[..., 1], x1[..., 0]), -1).flatten(-2)
    out = x.float() * cos[None, :, None, :] + rot * sin[None, :, None, :]
    return out.type_as(x)


class _Attn(nn.Module):
    def __init__(self, heads: int, cp: bool, mode: str, transport: str = "torch", attention=None) -> None:
        super().__init__()
        self.heads, self.cp, self.mode, self.transport, self.attention = heads, cp, mode, transport, attention

    def forward(self, q, k, v):
        if self.attention is not None:
            return self.attention(q, k, v)
        if self.cp:
            return cp_ops.attention(q, k, v, mode=self.mode, transport=self.transport)
        return cp_ops.local_attention(q, k, v)


class WanBlock(nn.Module):
    """Wan 2.x self-attention: q, k, v computed in that order; RMSNorm over dim; 3-D RoPE."""

    def __init__(self, dim: int, heads: int, cp: bool = True, mode: str = "agkv", transport: str = "torch",
                 attention=None) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)
        self.attn = _Attn(heads, cp, mode, transport, attention)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.norm_q(self.to_q(x)).unflatten(-1, (self.heads, -1))
        k = self.norm_k(self.to_k(x)).unflatten(-1, (self.heads, -1))
        v = self.to_v(x).unflatten(-1, (self.heads, -1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.attn(q, k, v)
        return self.to_out(o.flatten(-2))


class FluxBlock(nn.Module):
    """Z-Image/Flux style joint attention: text and image tokens projected separately, per-head RMSNorm,
    concatenated [text, image] along the sequence, RoPE on the joint sequence."""

    def __init__(self, dim: int, heads: int, cp: bool = True, mode: str = "agkv") -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.add_q, self.add_k, self.add_v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(self.head_dim), RMSNorm(self.head_dim)
        self.norm_add_q, self.norm_add_k = RMSNorm(self.head_dim), RMSNorm(self.head_dim)
        self.to_out = nn.Linear(dim, dim)
        self.attn = _Attn(heads, cp, mode)

    def forward(self, x, txt, cos, sin):
        h = self.heads
        q = torch.cat([self.norm_add_q(self.add_q(txt).unflatten(-1, (h, -1))), self.norm_q(self.to_q(x).unflatten(-1, (h, -1)))], 1)
        k = torch.cat([self.norm_add_k(self.add_k(txt).unflatten(-1, (h, -1))), self.norm_k(self.to_k(x).unflatten(-1, (h, -1)))], 1)
        v = torch.cat([self.add_v(txt), self.to_v(x)], 1).unflatten(-1, (h, -1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.attn(q, k, v)
        return self.to_out(o.flatten(-2))


class FusedQKVBlock(nn.Module):
    """One QKV GEMM (``to_qkv``), split, RMSNorm over dim on q and k, RoPE."""

    def __init__(self, dim: int, heads: int, cp: bool = True, mode: str = "agkv") -> None:
        super().__init__()
        self.heads = heads
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)
        self.attn = _Attn(heads, cp, mode)

    def forward(self, x, cos, sin):
        q, k, v = self.to_qkv(x).chunk(3, -1)
        q = self.norm_q(q).unflatten(-1, (self.heads, -1))
        k = self.norm_k(k).unflatten(-1, (self.heads, -1))
        v = v.unflatten(-1, (self.heads, -1))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.to_out(self.attn(q, k, v).flatten(-2))


class Stack(nn.Module):
    """``layers`` WanBlocks with residual connections: one window per layer in one graph."""

    def __init__(self, dim: int, heads: int, layers: int = 2, cp: bool = True, mode: str = "agkv") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(WanBlock(dim, heads, cp, mode) for _ in range(layers))

    def forward(self, x, cos, sin):
        for blk in self.blocks:
            x = x + blk(x, cos, sin)
        return x


class KVFirst(nn.Module):
    """Independent attentions whose K and V are all computed before the first attention (as in
    ``shared/repros/pass_three_inflight.py``): the overlap pass could put every K/V launch in flight at once.

    Takes ``x [n, B, S_local, dim]`` (n chunks, each its own attention over its tokens); returns the n
    outputs concatenated on the sequence, ``[B, n*S_local, dim]``. Q of chunk i is ``2 * x[i]``, kept only
    where every K and V is finite (a guard that reads them all first; it changes no value when they are, and
    keeps Inductor's ``reorder_for_locality`` from moving each projection down to its own attention).
    """

    def __init__(self, dim: int, heads: int, cp: bool = True, mode: str = "agkv", transport: str = "torch") -> None:
        super().__init__()
        self.heads = heads
        self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.attn = _Attn(heads, cp, mode, transport)

    def forward(self, x):
        n, h = x.shape[0], self.heads
        ks = [self.to_k(x[i]).unflatten(-1, (h, -1)) for i in range(n)]
        vs = [self.to_v(x[i]).unflatten(-1, (h, -1)) for i in range(n)]
        finite = torch.stack([t.isfinite().all() for t in ks + vs]).all()
        qs = [torch.where(finite, x[i] * 2.0, torch.nan).unflatten(-1, (h, -1)) for i in range(n)]
        return torch.cat([self.attn(q, k, v) for q, k, v in zip(qs, ks, vs)], 1).flatten(-2)


class KVFirstStack(nn.Module):
    """``layers`` :class:`KVFirst` blocks, each fed the previous one's output (``x [n, B, S_local, dim]`` in and out)."""

    def __init__(self, dim: int, heads: int, layers: int = 2, cp: bool = True, mode: str = "agkv",
                 transport: str = "torch") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(KVFirst(dim, heads, cp, mode, transport) for _ in range(layers))

    def forward(self, x):
        n, s = x.shape[0], x.shape[2]
        for blk in self.blocks:
            x = blk(x).unflatten(1, (n, s)).movedim(1, 0)
        return x
