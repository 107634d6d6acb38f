"""Pipelined Ulysses: the heads of each rank's head group are split into ``g`` sub-groups that travel and are
attended one after another, so that the all-to-all of sub-group i+1 runs while sub-group i is attended, and
the inverse all-to-all of sub-group i runs under sub-group i+1's attention. Exact (each head's attention is
computed whole; no merge).

Sub-group i takes, from every destination rank's head block ``[t*Hl, (t+1)*Hl)`` (``Hl = H/W``), the heads
``[t*Hl + lo_i, t*Hl + hi_i)`` (``lo_i = i*Hl//g``); it is an ordinary Ulysses call on those heads
(``cp_ops::ulysses_start`` / ``ulysses_inverse_start``, each waited by ``wait_tensor``), so every transport
and the compiler see the usual launches. Eagerly, a transport with ``ulysses_start_heads(xs, group, lo, hi)`` (torch,
fast) sends a sub-group straight from q, k, v (no copy of the sub-group's heads first). ``g = min(chunks, Hl)``. At most two launches of one kind are in flight
(the fast transport's pooled buffers: ``slots_per_key`` = 2): sub-group i+2 is launched after sub-group i's
buffer has been read, and the inverse of sub-group i is unpacked before sub-group i+2's inverse starts.

Method: DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509), head-chunked as in its later overlap work.
"""

from __future__ import annotations

import torch

from .. import _library as lib
from .. import layout


def _heads(x: torch.Tensor, world_size: int, lo: int, hi: int) -> torch.Tensor:
    """``[B, S, H, D]`` → ``[B, S, W*(hi-lo), D]``: heads ``[lo, hi)`` of every rank's head block (a copy)."""
    b, s, h, d = x.shape
    if lo == 0 and hi == h // world_size:
        return x
    return x.reshape(b, s, world_size, h // world_size, d)[:, :, :, lo:hi].reshape(b, s, world_size * (hi - lo), d)


def ulysses_pipelined_attention(q, k, v, *, world_size: int, group_name: str, transport: str, scale=None,
                                chunks: int = 2) -> torch.Tensor:
    """Pipelined Ulysses (see the module docstring). Shapes as :func:`cp_ops.attention`; W must divide H.

    Returns ``[B, S_local, H, D]`` in q's dtype (contiguous)."""
    w = world_size
    return _run(q, k, v, w, scale, chunks,
                lambda lo, hi: torch.ops.cp_ops.ulysses_start([_heads(x, w, lo, hi) for x in (q, k, v)], w, group_name,
                                                              transport),
                lambda x: torch.ops.cp_ops.ulysses_inverse_start(x, w, group_name, transport), lib.wait,
                lambda buf: [layout.ulysses_unpack(buf, j) for j in range(3)])


def _launched(pair):
    """The buffer of a transport's ``(buf, work)`` launch, once the current stream waits for it."""
    pair[1].wait()
    return pair[0]


def _ulysses_pipelined_eager(q, k, v, pg, transport, scale, chunks) -> torch.Tensor:
    """Eager pipelined Ulysses without the dispatcher (cp_ops._eager): the same schedule on the transport object's
    launches and works."""
    w = pg.size()
    heads = getattr(transport, "ulysses_start_heads", None)  # packs a sub-group straight from q, k, v
    if heads is not None:
        def start(lo, hi):
            return heads([q, k, v], pg, lo, hi)
    else:
        def start(lo, hi):
            return transport.ulysses_start([_heads(x, w, lo, hi) for x in (q, k, v)], pg)
    return _run(q, k, v, w, scale, chunks, start, lambda x: transport.ulysses_inverse_start(x, pg), _launched,
                layout.ulysses_unpack_all)


def _run(q, k, v, w: int, scale, chunks: int, start, inverse, wait, unpack) -> torch.Tensor:
    """The schedule: ``start(lo, hi)`` launches heads ``[lo, hi)`` of every head group of q, k, v, ``inverse(x)``
    launches the way back, ``wait(launched)`` gives the received buffer,
    ``unpack(buf)`` its q, k, v (per slot when traced, the form the compiler sees; all at once eagerly)."""
    from ..attention import local_attention

    b, s, h, d = q.shape
    hl = h // w
    g = max(1, min(chunks, hl))
    cuts = [i * hl // g for i in range(g + 1)]
    spans = list(zip(cuts, cuts[1:]))
    starts: dict = {}
    inverses: dict = {}
    result = q.new_empty(b, s, w, hl, d)

    def launch(i):
        starts[i] = start(*spans[i])

    def finish(i):  # heads -> sequence result of sub-group i, copied out of the (maybe pooled) buffer
        back = wait(inverses.pop(i))  # [W, B, S_local, hl_i, D]
        lo, hi = spans[i]
        result[:, :, :, lo:hi].copy_(back.permute(1, 2, 0, 3, 4))

    launch(0)
    if g > 1:
        launch(1)
    for i in range(g):
        buf = wait(starts.pop(i))
        qh, kh, vh = unpack(buf)
        out = local_attention(qh, kh, vh, scale)
        inverses[i] = inverse(out)
        if i >= 1:
            finish(i - 1)
        if i + 2 < g:
            launch(i + 2)
    finish(g - 1)
    return result.view(b, s, h, d)


# the rank contract's signature of an eager call (one exchange): cp_ops::ulysses_start([q, k, v]) and its chunks
_ulysses_pipelined_eager.signature = lambda q, k, v, chunks: ("cp_ops::ulysses_start", q, 3, chunks)
ulysses_pipelined_attention.eager = _ulysses_pipelined_eager
