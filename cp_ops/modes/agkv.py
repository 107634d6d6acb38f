"""AGKV, transport-then-attend (chunks = 1): all-gather every rank's K/V, attend with the local Q (as in Megatron-LM's
context parallelism and xDiT). Any head count; moves 2·(W-1)/W of the global K/V to every rank. Bitwise equal to
one device (the same SDPA kernel sees the same K/V)."""

from __future__ import annotations

import torch

from ..kernels import local_attention


def agkv(q, k, v, comm, *, scale=None, chunks: int = 1, shards=None, key_mask=None) -> torch.Tensor:
    """The AGKV body (:mod:`cp_ops.modes`): ``[B, S_local, H, D]`` → ``[B, S_local, H, D]``. With ``shards``: the
    padded blocks travel; without a key mask the real rows are selected before attention (exact), with one the
    padded K/V are attended with the padding masked (:class:`cp_ops.layout.Shards`)."""
    if shards is None:
        kf, vf, _ = comm.agkv(k, v).wait()
        return local_attention(q, kf, vf, scale)
    if key_mask is None:
        kf, vf, _ = comm.agkv(shards.pad(k), shards.pad(v)).wait()
        return local_attention(q, shards.rows(kf), shards.rows(vf), scale)
    every = shards.every_key(key_mask)  # every key's mask [B, total]: nothing to gather
    kf, vf, mf = comm.agkv(shards.pad(k, zero=True), shards.pad(v, zero=True),
                           None if every else shards.pad_mask(key_mask)).wait()
    return local_attention(q, kf, vf, scale, shards.padded_mask(key_mask, mf, q.shape[0]))
