"""cp_ops.plan.measured's in-memory choices (what mode='auto' / chunks=None decided per request) on real gloo ranks: a destroyed
group's entries go when cp_ops notices it (they held the group object, and so its gloo threads and sockets, forever),
and the memo keeps at most MAX_MEMO requests. The calls stay equal to single-device attention throughout."""

import torch
import torch.distributed as dist

import cp_ops
from cp_ops import layout
from cp_ops.plan import measured as choices
from dist_util import run_ranks


def _attend(rank, w, s_local, seed, group):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, w * s_local, 2 * w, 8, generator=g) for _ in range(3))
    sh = lambda t: layout.shard(t, 1, rank, w)  # noqa: E731
    out = cp_ops.attention(sh(q), sh(k), sh(v), group=group)  # mode='auto', chunks=None: a stored choice
    torch.testing.assert_close(out, sh(cp_ops.local_attention(q, k, v)), rtol=1e-5, atol=1e-5)


def _memo(rank, w):
    old = dist.new_group(list(range(w)))
    _attend(rank, w, 4, 1, old)
    assert any(key[0] is old for key in choices._memo)
    dist.destroy_process_group(old)
    new = dist.new_group(list(range(w)))
    _attend(rank, w, 4, 2, new)  # the first call on a new group: cp_ops notices the destroyed one
    assert not any(key[0] is old for key in choices._memo), [key[:3] for key in choices._memo]
    assert any(key[0] is new for key in choices._memo)
    # the cap: the oldest request goes first; a request dropped is decided again (alike on every rank) at its next call
    choices.MAX_MEMO = 3
    for s in (1, 2, 3, 5, 6):
        _attend(rank, w, s, 10 + s, new)
    assert [key[3][1] for key in choices._memo] == [3, 5, 6], [key[3] for key in choices._memo]  # S_local
    _attend(rank, w, 7, 20, new)
    assert [key[3][1] for key in choices._memo] == [5, 6, 7]


def test_choices_drop_destroyed_groups_and_are_capped():
    run_ranks(_memo, 2)
