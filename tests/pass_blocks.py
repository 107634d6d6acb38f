"""Small DiT attention blocks for the overlap-pass tests and benchmark (BSHD, context-parallel attention).

Blocks (all take the local token shard ``x [B, S_local, dim]`` and RoPE tables ``cos, sin [S_local, D]``):
    WanBlock        Q/K/V projections, RMSNorm over all heads (dim) on q and k, 3-D RoPE, attention, output proj.
    FluxBlock       Z-Image/Flux style: per-head RMSNorm (head_dim), joint text + image tokens (concatenated).
    FusedQKVBlock   one fused QKV GEMM, then split, norms, RoPE.
    Stack           several WanBlocks with residuals: several windows in one graph.
``cp=False`` replaces CP attention with single-device attention (no cp ops in the graph).
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
    """3-D RoPE (frames, height, width): ``cos, sin [count, head_dim]`` for tokens ``offset..offset+count``.

    head_dim is split over the three axes (as Wan does: the frame axis gets the remainder), pairs interleaved.
    """
    f, h, w = grid
    d_h = d_w = 2 * (head_dim // 6)
    d_f = head_dim - d_h - d_w
    pos = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1).reshape(-1, 3)
    angles = []
    for axis, d in enumerate((d_f, d_h, d_w)):
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles.append(pos[:, axis, None].double() * inv)
    ang = torch.cat(angles, -1).repeat_interleave(2, -1)  # [S, head_dim]
    count = pos.shape[0] - offset if count is None else count
    ang = ang[offset : offset + count]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, S, H, D]``; cos/sin ``[S, D]``; rotate interleaved pairs (x0, x1) → (x0 c - x1 s, x1 c + x0 s)."""
    x1 = x.float().unflatten(-1, (-1, 2))
    rot = torch.stack((-x1[..., 1], x1[..., 0]), -1).flatten(-2)
    out = x.float() * cos[None, :, None, :] + rot * sin[None, :, None, :]
    return out.type_as(x)


class _Attn(nn.Module):
    def __init__(self, heads: int, cp: bool, mode: str) -> None:
        super().__init__()
        self.heads, self.cp, self.mode = heads, cp, mode

    def forward(self, q, k, v):
        if self.cp:
            return cp_ops.attention(q, k, v, mode=self.mode, transport="torch")
        return cp_ops.local_attention(q, k, v)


class WanBlock(nn.Module):
    """Wan 2.x self-attention: q, k, v computed in that order; RMSNorm over dim; 3-D RoPE."""

    def __init__(self, dim: int, heads: int, cp: bool = True, mode: str = "agkv") -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)
        self.attn = _Attn(heads, cp, mode)

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
