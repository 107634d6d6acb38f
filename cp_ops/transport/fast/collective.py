"""Host-side collectives of the fast lane over its group: a barrier that also drains the device, and the agreed
outcome of one start-up stage (:class:`StartFailed` on every rank when any rank failed)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class StartFailed(RuntimeError):
    """The lane could not start on some rank of the group; every rank raises this with the same message."""


def group_barrier(group: dist.ProcessGroup, device) -> None:
    """Host-side barrier over ``group``: every rank's host reaches it, and the device's prior work is done.

    Not ``dist.barrier``: ProcessGroupNCCL keeps the tensor its barrier reduces alive between calls, so a first
    barrier inside ``torch.compile(mode="reduce-overhead")``'s warm-up (which runs in the CUDA-graph pool) leaves
    a tensor there that no graph output tracks, and the CUDA-graph trees refuse to go on ("Detected 1 tensor(s)
    in the cudagraph pool not tracked as outputs"). A temporary all-reduced and synchronized does the same work.
    """
    if dist.get_backend(group) != "nccl":  # the protocol tests' lanes on CPU ranks (gloo): no device memory
        dist.barrier(group=group)
        return
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    t = torch.ones(1, device=dev)
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize(dev)
    del t


def agree_outcome(group: dist.ProcessGroup, stage: str, error: str | None) -> None:
    """All-gather one start-up stage's outcome over the group (bounded by the group's timeout); raise
    :class:`StartFailed` on every rank, naming the failing ranks and their messages, if any rank failed."""
    outs = [None] * group.size()
    dist.all_gather_object(outs, error, group=group)
    bad = [(r, e) for r, e in enumerate(outs) if e is not None]
    if bad:
        raise StartFailed(f"{stage} failed on " + "; ".join(f"group rank {r}: {e}" for r, e in bad))
