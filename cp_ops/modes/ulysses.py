"""Ulysses: all-to-all sequence → heads, attend on H/W heads of the full sequence, all-to-all back
(DeepSpeed-Ulysses, arXiv:2309.14509). W must divide H. Exact at every ``chunks``.

``chunks = g ≥ 2``: each rank's heads split into ``min(g, H/W)`` sub-groups that travel and are attended one after
another (sub-group i takes heads ``[i*Hl//g, (i+1)*Hl//g)`` of every destination's block), so the all-to-all of i+1
and the inverse of i run under i's and i+1's attention; no merge. At most two launches of one kind are in flight
(the fast transport's ``slots_per_key`` = 2); where one sub-group already makes two launches of one kind (two FP8
formats of one tensor each), one sub-group is in flight. Uneven shards / key mask: q, k, v padded to ``smax`` rows,
:class:`cp_ops.layout.Shards` takes the real rows (or masks the padding; the mask gathered beside the first
sub-group). ``chunks = 1``: one group of all heads, the way back unpacked in one copy.
"""

from __future__ import annotations

import operator

import torch

from .. import layout
from ..kernels import local_attention


def ulysses(q, k, v, comm, *, scale=None, chunks: int = 1, shards=None, key_mask=None) -> torch.Tensor:
    """The Ulysses body (:mod:`cp_ops.modes`): ``[B, S_local, H, D]`` → ``[B, S_local, H, D]`` (contiguous, q's dtype)."""
    w = comm.world
    b, s, h, d = q.shape
    # heads per rank as an int: a symbolic count (dynamic=True) made cuts Inductor could not lower; a model's head
    # count is a constant, so the guard recompiles nothing
    hl = operator.index(h // w)
    g = max(1, min(chunks, hl))
    select = shards is not None and key_mask is None  # uneven without a mask: the real rows are selected
    if shards is not None:  # (with a mask the padding rows are attended, masked: zeros)
        masked = key_mask is not None
        q, k, v = shards.pad(q, masked), shards.pad(k, masked), shards.pad(v, masked)
    if g == 1:  # transport-then-attend: all heads at once, one copying unpack of the way back
        m4 = None
        pending = comm.ulysses([q, k, v])  # the call's first launch: the rank contract's exchange
        if key_mask is not None:
            m4 = shards.attend_padded(key_mask, comm, b)
        buf = pending.wait()
        qh, kh, vh = shards.ulysses_rows(buf, comm.unpack) if select else comm.unpack(buf)
        out = local_attention(qh, kh, vh, scale, m4)
        back = comm.ulysses_inverse(shards.repad(out) if select else out).wait()
        return layout.ulysses_inverse_unpack(back) if shards is None else shards.inverse_rows(back)
    cuts = [i * hl // g for i in range(g + 1)]
    spans = list(zip(cuts, cuts[1:]))
    starts: dict = {}
    inverses: dict = {}
    read: dict = {}  # sub-group i -> a tensor made once its received buffers were read (decoded / attended)
    done: dict = {}  # sub-group i -> its heads of the result, written from its inverse's buffer
    result = q.new_empty(b, s, w, hl, d)

    # Launch i of a kind reuses the pool slot of launch i - 2 (or i - 1: ahead = 1): each launch takes as `after`
    # what read that launch's output, so traced code keeps the order too (Inductor otherwise fused the copies out
    # of three inverse launches into one kernel after all three: three in flight on a 2-slot pool).
    def launch(i):
        starts[i] = comm.ulysses([q, k, v], *spans[i], after=read.pop(i - ahead, None))

    def finish(i):  # heads -> sequence result of sub-group i, copied out of the (maybe pooled) buffer
        lo, hi = spans[i]  # (received [W, B, S_local or smax, hl_i, D]; FP8: decoded straight into result)
        done[i] = inverses.pop(i).wait_into(result[:, :, :, lo:hi])

    # sub-groups in flight: two, or one where a sub-group's launches share a pool key (two FP8 formats of one tensor
    # each); then sub-group i+1 is launched once sub-group i's buffers were waited (decoded, so read: the slots are free)
    ahead = 2 if comm.ulysses_launches_per_key() < 2 else 1
    launch(0)  # the call's first launch: the rank contract's exchange
    m4 = None
    if key_mask is not None:
        m4 = shards.attend_padded(key_mask, comm, b)
    if g > 1 and ahead == 2:
        launch(1)
    for i in range(g):
        buf = starts.pop(i).wait()
        qh, kh, vh = shards.ulysses_rows(buf, comm.unpack) if select else comm.unpack(buf)
        if ahead == 1 and i + 1 < g:
            read[i] = qh  # FP8: q, k, v decoded by the wait into one tensor (qh a view): every buffer was read
            launch(i + 1)
        out = local_attention(qh, kh, vh, scale, m4)
        if ahead == 2:
            read[i] = out
        inverses[i] = comm.ulysses_inverse(shards.repad(out) if select else out, after=done.pop(i - 2, None))
        if i >= 1:
            finish(i - 1)
        if ahead == 2 and i + 2 < g:
            launch(i + 2)
    finish(g - 1)
    return result.view(b, s, h, d)
