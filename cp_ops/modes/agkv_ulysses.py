"""2-D CP: Ulysses over the inner dim of a mesh, AGKV of the Ulysses-local K/V over the outer dim.

The CP group is a 2-D ``DeviceMesh`` ``(outer O, inner I)`` (``mesh_dim_names=("agkv", "ulysses")``); W = O·I ranks,
rank ``r = o·I + i`` (row-major) holds the r-th token block, so row ``o`` (the I ranks of one inner group) holds a
contiguous run of tokens. Steps (``comm`` is a :class:`cp_ops.comm.MeshComm`: ``comm.inner``, ``comm.outer``):

1. Ulysses all-to-all over the inner group: this rank gets its row's tokens for H/I heads (head group ``i``).
2. AGKV over the outer group: the ranks of equal ``i`` (one per row) gather each other's K/V of head group ``i``, so
   this rank holds all W blocks' K/V for its H/I heads; its Q stays its row's tokens.
3. Attention of the row's Q against all K/V (H/I heads): the 1-D AGKV body (:mod:`.agkv`) run on ``comm.outer``;
   ``chunks ≥ 2``: the pipelined AGKV body (:mod:`.agkv_pipelined`: the own row's K/V attended while the other rows'
   land, merged by LSE; traced code runs it inside ``cp_ops::agkv_pipelined_attention``, as 1-D AGKV does).
4. The inverse all-to-all over the inner group: back to this rank's tokens, all heads.

Bytes per rank per call, in units of one local tensor (``B·S_local·H·D`` elements): 4·(I−1)/I over the inner links
(Q, K, V in, the output back), 2·(O−1) over the outer links (K and V of each other row for H/I heads: I·S_local
tokens × H/I heads each); :mod:`cp_ops.cost` turns these into times. With I = 1 it is AGKV, with O = 1 Ulysses (the
plan runs the 1-D modes for those meshes).

Uneven shards / key mask (``shards``: a :class:`cp_ops.mesh.MeshShards`): the inner step pads to the row's largest
block and selects the row's real tokens (as 1-D Ulysses does), the outer step pads rows to the largest row and selects
the real tokens of all rows (as 1-D AGKV does; with a key mask it attends the padded rows, the padding masked); the
mask is gathered over the inner group beside the Ulysses launch (the row's mask) and travels with the K/V over the
outer group. Exact: with chunks = 1 every SDPA call sees the same Q rows, K/V and mask as one device's call for that
row and head group (bitwise equal; with a mask on rows of unequal sizes, its call over the padded keys).

Method: the 2-D Ulysses × all-gather-K/V layout (as TensorRT-LLM's Attention2D and USP's Ulysses × ring, Fang & Zhao,
2024, arXiv:2405.07719, with AGKV in place of the ring); DeepSpeed-Ulysses (arXiv:2309.14509).
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
