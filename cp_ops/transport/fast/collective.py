"""Host-side collectives of the fast lane over its group: a barrier that also drains the device, and bounded exchanges
with one agreed outcome (start-up stages, pool growth, the reclaim of flag slots freed with their graph).
:class:`Exchange` goes through the default c10d store: it needs no CUDA (usable while capturing a CUDA graph and after a
device fault), a missing rank costs the others ``CP_OPS_TIMEOUT_S`` at most, and every rank gets the *same* result (the
store's compare-and-set decides), so no rank goes on with the lane while another gave up.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from ... import config


class StartFailed(RuntimeError):
    """The lane could not start on some rank of the group; every rank raises this with the same message."""


class PeerTimeout(RuntimeError):
    """Some group ranks did not take part in an :class:`Exchange` within its bound; every rank that reaches the
    exchange raises this with the same message (a rank arriving late too)."""


def group_barrier(group: dist.ProcessGroup, device) -> None:
    """Host-side barrier over ``group``: every rank's host reaches it, and the device's prior work is done.

    Not ``dist.barrier``: ProcessGroupNCCL keeps its barrier's tensor alive, which inside
    ``torch.compile(mode="reduce-overhead")``'s warm-up lands in the CUDA-graph pool untracked, and the CUDA-graph
    trees refuse to go on ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs").
    """
    if dist.get_backend(group) != "nccl":  # the protocol tests' lanes on CPU ranks (gloo): no device memory
        dist.barrier(group=group)
        return
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    t = torch.ones(1, device=dev)
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize(dev)


_made: dict = {}  # (group name, tag) -> Exchange objects made (names each one's store keys)


class Exchange:
    """A bounded all-gather of small picklable objects over ``group``'s ranks through the default c10d store.

    ``Exchange(group, tag)(what, obj)`` posts ``obj`` and returns every group rank's object, the same list on every
    rank. Objects (per group and tag) and their exchanges are numbered in order, so every rank must make the same
    ones in the same order. Store keys: ``cp_ops/fast/<group name>/<tag>.<k>/<n>/...``.

    Raises:
        PeerTimeout: some rank did not post within ``timeout_s`` (default ``settings.timeout_s``); the same
            message, naming the missing ranks and the bound, on every rank.
    """

    def __init__(self, group: dist.ProcessGroup, tag: str, timeout_s: float | None = None, store=None):
        if store is None:
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        self.rank, self.size = group.rank(), group.size()
        self.ranks = dist.get_process_group_ranks(group)
        self.timeout_s = timeout_s
        k = _made[(group.group_name, tag)] = _made.get((group.group_name, tag), -1) + 1
        self.store = dist.PrefixStore(f"cp_ops/fast/{group.group_name}/{tag}.{k}/", store)
        self.count = 0

    def __call__(self, what: str, obj, timeout_s: float | None = None) -> list:
        """Every group rank's ``obj`` (``timeout_s``: this exchange's bound, default the object's)."""
        n = self.count
        self.count += 1
        bound = timeout_s or (config.settings.timeout_s if self.timeout_s is None else self.timeout_s)
        keys = [f"{n}/{r}" for r in range(self.size)]
        self.store.set(keys[self.rank], pickle.dumps(obj))
        try:
            self.store.wait(keys, datetime.timedelta(seconds=bound))
            view = ("ok", [pickle.loads(self.store.get(k)) for k in keys])
        except RuntimeError:  # DistStoreError: a key did not appear within the bound
            view = ("missing", [r for r, k in enumerate(keys) if not self.store.check([k])])
        # the first rank to finish (with every object, or with a timeout) decides for all
        outcome, value = pickle.loads(self.store.compare_set(f"{n}/outcome", "", pickle.dumps(view)))
        if outcome == "missing":
            raise PeerTimeout(
                f"cp_ops fast transport: {what}: group ranks {value} (global ranks {[self.ranks[r] for r in value]}) "
                f"of CP group {self.ranks} did not take part within {bound:g} s (CP_OPS_TIMEOUT_S): stuck, crashed, or "
                "not making the same fast calls")
        return value


def agree_outcome(exchange, stage: str, error: str | None, timeout_s: float | None = None) -> None:
    """Exchange one start-up stage's outcome (``error``: None = this rank succeeded) through ``exchange``
    (bounded by ``timeout_s``, default the exchange's); if any rank failed, raise :class:`StartFailed` on every rank
    naming the failing (or missing) ranks and their messages."""
    try:
        outs = exchange(stage, error, timeout_s)
    except PeerTimeout as e:
        raise StartFailed(f"{stage} failed: {e}") from None
    bad = [(r, e) for r, e in enumerate(outs) if e is not None]
    if bad:
        raise StartFailed(f"{stage} failed on " + "; ".join(f"group rank {r}: {e}" for r, e in bad))
