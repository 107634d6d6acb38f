"""2-D CP: Ulysses over the inner dim of a mesh, AGKV of the Ulysses-local K/V over the outer dim (docs/2d.md).

``comm`` is a :class:`cp_ops.comm.MeshComm`. Steps: (1) Ulysses all-to-all over the inner group (this rank gets its
row's tokens for H/I heads); (2)-(3) the 1-D AGKV body (:mod:`.agkv`, pipelined for ``chunks ≥ 2``) on
``comm.outer``; (4) the inverse all-to-all over the inner group. Uneven shards / key mask (a
:class:`cp_ops.mesh.MeshShards`): each step pads and selects as its 1-D body does; the mask is gathered over the
inner group beside the Ulysses launch and travels with the K/V over the outer group.

Method: the 2-D Ulysses × all-gather-K/V layout (TensorRT-LLM's Attention2D; USP, arXiv:2405.07719, with AGKV in
place of the ring).
"""

from __future__ import annotations

import torch

from .. import layout
from .agkv import agkv
from .agkv_pipelined import agkv_pipelined


def agkv_ulysses(q, k, v, comm, *, scale=None, chunks: int = 1, shards=None, key_mask=None) -> torch.Tensor:
    """The 2-D body (:mod:`cp_ops.modes`): ``[B, S_local, H, D]`` → ``[B, S_local, H, D]`` (contiguous, q's dtype).
    ``comm``: a :class:`cp_ops.comm.MeshComm`; ``shards``: a :class:`cp_ops.mesh.MeshShards` or None."""
    inner, outer = comm.inner, comm.outer
    si, so = (None, None) if shards is None else (shards.inner, shards.outer)
    b = q.shape[0]
    if si is not None:
        q, k, v = si.pad(q), si.pad(k), si.pad(v)
    pending = inner.ulysses([q, k, v])  # the inner group's first launch: its rank-contract exchange
    row_mask = None
    if key_mask is not None:
        row_mask = si.mask(inner.mask(si.pad_mask(key_mask)).wait(), b).view(b, si.total)
    buf = pending.wait()
    qh, kh, vh = inner.unpack(buf) if si is None else si.ulysses_rows(buf, inner.unpack)
    if chunks > 1:
        if hasattr(outer, "agkv_sources"):  # the direct comm: the pipelined body itself
            out = agkv_pipelined(qh, kh, vh, outer, scale=scale, chunks=chunks, shards=so)
        else:  # traced: the same body inside one op (cp_ops::agkv_pipelined_attention)
            out = outer.agkv_attention(qh, kh, vh, scale, chunks)
    else:
        out = agkv(qh, kh, vh, outer, scale=scale, shards=so, key_mask=row_mask)
    back = inner.ulysses_inverse(out if si is None else si.repad(out)).wait()
    return layout.ulysses_inverse_unpack(back) if si is None else si.inverse_rows(back)
