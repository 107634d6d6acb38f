"""A test-side process-group backend, ``'staged'``: every collective on CUDA (or CPU) tensors is copied to host
memory, run by gloo on CPU tensors, and its results copied back into the caller's tensors.

Why: ranks that share one GPU cannot use NCCL (it refuses two ranks on one device), and gloo's own CUDA-tensor path
died with SIGSEGV on an H100 (torch 2.11) in the collectives other libraries' context parallelism calls (c10d
functional ``all_gather_into_tensor`` / ``all_to_all_single`` on a ``cpu:gloo,cuda:gloo`` group). cp_ops' own
gathers never take that path; the peers (tests/test_one_gpu_peers.py) do. Staged through host memory, the same
calls are plain gloo on CPU tensors. Only the tests use it: cp_ops does not know it exists.

How: :class:`StagedGroup` is a Python :class:`torch.distributed.ProcessGroup` (as torch's ``multi_threaded_pg`` and
``cp_ops.cli.bound_fill`` make them) whose collectives are Python methods; c10d's C++ side calls them for the
functional collectives (``torch.distributed._functional_collectives``, eager or in a ``torch.compile`` graph) and
``dist.*`` calls them directly. Each collective copies its tensors to fresh contiguous CPU tensors, runs the same call
on an inner ``ProcessGroupGloo`` over the same ranks, waits, copies the written tensors back, and returns a completed
work: synchronous, like a blocking gloo call. ``send`` returns gloo's work (its host copy is made before it returns);
``recv`` returns a work whose ``wait()`` waits for gloo's receive and then copies into the caller's tensor, so
``batch_isend_irecv`` in any order does not deadlock. Methods carry both torch 2.11's and 2.13's names
(``_allgather_base`` / ``all_gather_single``, ``alltoall_base`` / ``all_to_all_single``, ...). The inner gloo is
also the group's registered backend for CPU tensors (a call this class does not override still works there);
none is registered for CUDA, so a CUDA call it does not override raises instead of reaching gloo's CUDA path.
:data:`CALLS` counts the staged calls by kind.

Use: :func:`register` (once per process), then ``dist.init_process_group("staged", ...)`` or
``dist.new_group(backend="staged")``; groups made from it (``new_group``, ``DeviceMesh``) are staged too.
``tests/dist_util.run_ranks(fn, W, device="one_gpu", backend="staged")`` makes it every rank's default group (also
on CPU ranks: ``device="cpu"``). Checked against gloo, bitwise, in tests/test_staged_pg.py.
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from cp_ops.cli.bound_fill import completed_work, let_dynamo_trace

#: staged calls by kind (this process)
CALLS: collections.Counter = collections.Counter()
def _host(x):
    """``x`` with every tensor (in nested lists) replaced by a fresh contiguous CPU copy; anything else as is."""
    if isinstance(x, torch.Tensor):
        return torch.empty(x.shape, dtype=x.dtype).copy_(x.detach())
    if isinstance(x, (list, tuple)):
        return [_host(v) for v in x]
    return x


def _back(x, host) -> None:
    """Copy ``host`` (:func:`_host` of ``x``) back into ``x``'s tensors."""
    if isinstance(x, torch.Tensor):
        with torch.no_grad():
            x.copy_(host)
    else:
        for v, h in zip(x, host):
            _back(v, h)


class _Recv(dist.Work):
    """A staged receive: ``wait()`` waits for gloo's receive into the host copies, then copies them back."""

    def __init__(self, inner, tensors, host):
        super().__init__()
        self._inner, self._tensors, self._host, self._copied = inner, tensors, host, False

    def wait(self, timeout=None):
        if not self._copied:
            self._inner.wait() if timeout is None else self._inner.wait(timeout)
            _back(self._tensors, self._host)
            self._copied = True
        return True

    def is_completed(self):
        return self._copied


class StagedGroup(dist.ProcessGroup):
    """A process group whose collectives run on an inner gloo group (``inner``, the same ranks) on host copies of
    their tensors (see the module docstring)."""

    def __init__(self, inner, rank: int, size: int):
        super().__init__(rank, size)
        self._gloo = inner
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, inner)

    def getBackendName(self):
        return "staged"

    def _run(self, kind: str, args: tuple, written: tuple, via: str | None = None):
        """gloo's ``via`` (default ``kind``) on host copies of ``args``; the arguments at ``written`` copied back."""
        CALLS[kind] += 1
        host = [_host(a) for a in args]
        getattr(self._gloo, via or kind)(*host).wait()
        for i in written:
            _back(args[i], host[i])
        return completed_work()

    # gathers
    def allgather(self, outs, ins, opts=None):
        return self._run("allgather", (outs, ins, opts or dist.AllgatherOptions()), (0,))

    def _allgather_base(self, out, inp, opts=None):
        return self._run("_allgather_base", (out, inp, opts or dist.AllgatherOptions()), (0,))

    all_gather_single = _allgather_base  # torch >= 2.13's name

    def _coalesced(self, kind: str, via: str, outs, ins, opts):
        """A coalesced call (counted as ``kind``): gloo's ``via`` on each (output, input) pair."""
        for out, inp in zip(outs, ins):
            self._run(kind, (out, inp, opts), (0,), via=via)
        return completed_work()

    def allgather_into_tensor_coalesced(self, outs, ins, opts=None):
        return self._coalesced("allgather_into_tensor_coalesced", "_allgather_base", outs, ins,
                               opts or dist.AllgatherOptions())

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, outs, ins, opts=None):
        return self._run("gather", (outs, ins, opts or dist.GatherOptions()), (0,))

    # all-to-all
    def alltoall_base(self, out, inp, out_splits, in_splits, opts=None):
        return self._run("alltoall_base", (out, inp, list(out_splits), list(in_splits),
                                           opts or dist.AllToAllOptions()), (0,))

    all_to_all_single = alltoall_base

    def alltoall(self, outs, ins, opts=None):
        """gloo has no list all-to-all: the inputs go flat, each rank's part after the other's, through
        ``alltoall_base`` (one dtype)."""
        CALLS["alltoall"] += 1
        send = torch.cat([t.detach().reshape(-1).cpu() for t in ins])
        recv = torch.empty(sum(t.numel() for t in outs), dtype=outs[0].dtype)
        self._gloo.alltoall_base(recv, send, [t.numel() for t in outs], [t.numel() for t in ins],
                                 opts or dist.AllToAllOptions()).wait()
        for t, part in zip(outs, recv.split([t.numel() for t in outs])):
            with torch.no_grad():
                t.copy_(part.view(t.shape))
        return completed_work()

    # reductions
    def allreduce(self, tensors, opts=None):
        return self._run("allreduce", (tensors, opts or dist.AllreduceOptions()), (0,))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._run("allreduce_coalesced", (tensors, opts or dist.AllreduceCoalescedOptions()), (0,))

    def reduce(self, tensors, opts=None):
        return self._run("reduce", (tensors, opts or dist.ReduceOptions()), (0,))

    def reduce_scatter(self, outs, ins, opts=None):
        return self._run("reduce_scatter", (outs, ins, opts or dist.ReduceScatterOptions()), (0,))

    def _reduce_scatter_base(self, out, inp, opts=None):
        return self._run("_reduce_scatter_base", (out, inp, opts or dist.ReduceScatterOptions()), (0,))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outs, ins, opts=None):
        return self._coalesced("reduce_scatter_tensor_coalesced", "_reduce_scatter_base", outs, ins,
                               opts or dist.ReduceScatterOptions())

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # one to all, barrier
    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", (tensors, opts or dist.BroadcastOptions()), (0,))

    def scatter(self, outs, ins, opts=None):
        return self._run("scatter", (outs, ins, opts or dist.ScatterOptions()), (0,))

    def barrier(self, opts=None):
        CALLS["barrier"] += 1
        self._gloo.barrier(opts or dist.BarrierOptions()).wait()
        return completed_work()

    # point to point
    def send(self, tensors, dst, tag):
        CALLS["send"] += 1
        return self._gloo.send(_host(tensors), dst, tag)

    def recv(self, tensors, src, tag):
        CALLS["recv"] += 1
        host = _host(tensors)
        return _Recv(self._gloo.recv(host, src, tag), tensors, host)


def _create(common_opts, backend_opts):
    """The backend creator: an inner gloo group on the group's own store, wrapped."""
    store = dist.PrefixStore("staged/", common_opts.store)
    inner = dist.ProcessGroupGloo(store, common_opts.group_rank, common_opts.group_size, common_opts.timeout)
    return StagedGroup(inner, common_opts.group_rank, common_opts.group_size)


def register() -> None:
    """Register backend ``'staged'`` (CPU and CUDA tensors) in this process; a second call does nothing."""
    if "STAGED" not in dist.Backend._plugins:
        dist.Backend.register_backend("staged", _create, extended_api=True, devices=["cpu", "cuda"])
    let_dynamo_trace(StagedGroup)  # torch.compile of functional collectives on it, torch 2.11 too
