"""Fake process groups whose collectives write their outputs: realistic data for the zero-communication bound.

``cp-ops run --bound`` (:mod:`cp_ops.cli.bound`) times rank 0 of a W-rank *fake* process group
(``torch.testing._internal.distributed.fake_pg``). What a fake collective leaves in its output depends on torch:
newer torch copies the caller's input into every rank's slot (``alltoall_base``: output = input; all-gathers:
every chunk = the input); torch 2.11's fake backend does so for the all-gathers but leaves ``alltoall_base``'s
output *unwritten* (probed on an H200, 2026-12-01c) — the kernels after it then compute on whatever the allocator's
block held (zeros in fresh memory), and on an H200 attention and GEMMs ran 13-15 % faster on that than on real
values. Ulysses rows, where Q, K and V all come out of an all-to-all, read above linear.

:func:`enable` makes every fake collective cp_ops issues write what newer torch's fake backend writes — this
rank's own data in every source slot (real activations: the same magnitudes and statistics as the peers' would
have) — on torch versions whose fake backend does not (probed once per collective kind and device), and nothing
extra where torch already does. Either way each such write costs one device copy of the collective's output,
which the caller accounts for: :func:`recording` lists them and :func:`replay_ms` times the same copies alone.

The all-gathers cp_ops issues (the torch transport's AGKV gather, the key-mask gathers) are not run on a fake group
while filling is on: :func:`gather` writes their outputs itself, one copy per tensor, and returns a completed work.
The fake backend writes an all-gather one copy per chunk — a host loop over W (W kernel launches per tensor on CUDA,
where one rank's NCCL all-gather is one launch) that made rank 0's host time grow with W; the data written is the
same.

Covered: the torch transport's AGKV all-gather, its pipelined point-to-point gather (``recv`` never writes on any
fake backend: the received blocks are filled with the sent ones), Ulysses' all-to-alls, the key-mask all-gathers
and the diffusers integration's output gathers (not while ``torch.compile`` traces one: ``--bound-compile full``
gathers stay unwritten). Off by default; a real group is never touched (the check is per group).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

#: True between :func:`enable` and :func:`disable`; the transports read it before anything else (one global lookup)
ACTIVE = False
#: collective kind -> True when torch's fake backend leaves its output unwritten (so :func:`fill` writes it)
_unwritten: dict[str, bool] = {}
_records: list | None = None
#: process group object -> whether it is a fake group (a group's backend never changes; keyed by the object, not its
#: name: a later real group may reuse a destroyed fake group's name). Emptied by :func:`enable` and :func:`disable`.
_fake: dict = {}
#: a completed work (:func:`gather`'s), made once
_done = None

KINDS = ("alltoall_base", "_allgather_base", "allgather_into_tensor_coalesced", "recv")


def _probe(pg: dist.ProcessGroup, device: torch.device) -> dict[str, bool]:
    """For each of :data:`KINDS`: does ``pg`` (a fake group) leave the output unwritten? Tiny tensors on ``device``."""
    w = pg.size()
    inp = torch.arange(1, 2 * w + 1, dtype=torch.float32, device=device)
    res = {}
    out = torch.zeros(2 * w, device=device)
    pg.alltoall_base(out, inp, [], []).wait()
    res["alltoall_base"] = not torch.equal(out, inp)
    out = torch.zeros(w * inp.numel(), device=device)
    pg._allgather_base(out, inp).wait()
    res["_allgather_base"] = not torch.equal(out[: inp.numel()], inp)
    out = torch.zeros(w * inp.numel(), device=device)
    pg.allgather_into_tensor_coalesced([out], [inp]).wait()
    res["allgather_into_tensor_coalesced"] = not torch.equal(out[: inp.numel()], inp)
    res["recv"] = True  # no fake backend can know a peer's data
    return res


def enable(group: dist.ProcessGroup, device: torch.device) -> dict[str, bool]:
    """Turn filling on for every fake group of this process; ``group`` (a fake group) is probed on ``device`` for
    what torch's fake backend writes itself. Returns ``{kind: True when cp_ops writes it}`` after a collective of
    that kind (:func:`fill`); cp_ops' own all-gathers are written by cp_ops whatever it says (:func:`gather`).

    Raises:
        ValueError: ``group`` is not a fake group (backend name and ranks in the message).
    """
    global ACTIVE
    if str(dist.get_backend(group)) != "fake":
        raise ValueError(f"fake_fill.enable needs a group of the 'fake' backend (the zero-communication bound); got "
                         f"backend {dist.get_backend(group)!r} with {group.size()} ranks")
    _unwritten.update(_probe(group, torch.device(device)))
    _fake.clear()
    ACTIVE = True
    return dict(_unwritten)


def disable() -> None:
    """Turn filling off (what :func:`enable` turned on): fake collectives' outputs are left as the backend leaves
    them. Never raises."""
    global ACTIVE
    ACTIVE = False
    _fake.clear()


def _is_fake(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` is a fake group: asked once per group object (:data:`_fake`)."""
    v = _fake.get(pg)
    if v is None:
        v = _fake[pg] = str(dist.get_backend(pg)) == "fake"
    return v


def _note(kind: str, out: torch.Tensor, inp: torch.Tensor, by: str) -> None:
    if _records is not None:
        _records.append((kind, tuple(out.shape), tuple(inp.shape), out.dtype, out.device, by))


def _write(kind: str, out: torch.Tensor, inp: torch.Tensor) -> None:
    """What newer torch's fake backend writes: all-to-all: ``out = inp``; all-gathers and recv: every chunk of
    ``out`` along dim 0 = ``inp`` (``out`` holds ``W * len(inp)`` rows, or exactly ``inp``'s shape for recv)."""
    if kind == "alltoall_base" or out.shape == inp.shape:
        out.copy_(inp)
    else:
        w = out.shape[0] // inp.shape[0]
        out.view(w, *inp.shape).copy_(inp)


def fill(kind: str, pg: dist.ProcessGroup, out: torch.Tensor, inp: torch.Tensor) -> None:
    """After a collective of ``kind`` on ``pg`` wrote (or, on a fake group, did not write) ``out`` from ``inp``:
    on a fake group, record it (:func:`recording`) and write ``out`` where torch's fake backend does not. A no-op
    on any other group. Call only when :data:`ACTIVE` (the callers check it first)."""
    if not _is_fake(pg):
        return
    mine = _unwritten.get(kind, True)
    _note(kind, out, inp, "cp_ops" if mine else "torch")
    if mine:
        with torch.no_grad():
            _write(kind, out, inp)


def gather(kind: str, pg: dist.ProcessGroup, outs, ins):
    """An all-gather of ``kind`` (``'allgather_into_tensor_coalesced'`` or ``'_allgather_base'``) on ``pg``, written
    by cp_ops instead of run, when ``pg`` is a fake group: every ``outs[i]`` (``W`` chunks of ``ins[i]``'s shape along
    dim 0) gets ``ins[i]`` in each chunk with one copy (what the fake backend writes, one copy per chunk), recorded as
    cp_ops' write (:func:`recording`); returns a completed work (its ``wait()`` returns at once). On any other group
    returns None and does nothing: the caller runs the collective. Call only when :data:`ACTIVE` (the callers check
    it first)."""
    global _done
    if not _is_fake(pg):
        return None
    with torch.no_grad():
        for out, inp in zip(outs, ins):
            _note(kind, out, inp, "cp_ops")
            _write(kind, out, inp)
    if _done is None:
        fut = torch.futures.Future()
        fut.set_result(None)
        _done = torch._C._distributed_c10d._create_work_from_future(fut)
    return _done


@contextlib.contextmanager
def recording():
    """Collect ``(kind, out_shape, in_shape, dtype, device, by)`` of every fake collective write inside the block
    (``by``: ``'cp_ops'`` when :func:`fill` writes it, ``'torch'`` when torch's fake backend does); yields the list."""
    global _records
    prev, _records = _records, []
    try:
        yield _records
    finally:
        _records = prev


def _write_as_torch(out: torch.Tensor, inp: torch.Tensor) -> None:
    """What torch's fake backend does for the writes it makes (torch 2.11, seen in an H200 trace): one copy per
    chunk of ``out`` (W ``memcpy`` kernels for a W-rank all-gather), not one broadcast copy."""
    if out.shape == inp.shape:
        out.copy_(inp)
    else:
        for chunk in out.view(out.shape[0] // inp.shape[0], *inp.shape).unbind(0):
            chunk.copy_(inp)


def replay_ms(records: list, device: torch.device, repeats: int = 5, graphed: bool | None = None) -> float:
    """Device time in ms of the writes ``records`` lists (:func:`recording`), replayed alone on ``device`` on
    standard-normal inputs: what they add to a forward. Each write is replayed as its writer made it (cp_ops: one
    copy; torch's fake backend: one copy per chunk). Writes of one shape share one buffer pair, so the replay needs
    memory for one write of each shape only.

    ``graphed`` (default: on CUDA): all the writes are captured in one CUDA graph and its replay timed (median of
    ``repeats``), so the result is their device time without the host's launches — replayed one launch at a time
    the hundreds of ~3 µs copies of an image model are launch-bound (FLUX.1-dev at W = 8: 172 writes took 1.21 ms
    so, 0.45 ms of device time inside the forward's CUDA graphs), and taking that out of a forward would make its
    bound optimistic. Inside a host-bound eager forward the writes' launches cost host time too; they stay in
    rank 0's time (as a real collective's launch would). ``graphed=False`` (always on CPU): the writes launched
    back to back, timed as they run.

    Raises:
        RuntimeError: ``graphed=True`` off CUDA, or the capture failed.
    """
    from ..timing import Graphed, time_ms

    device = torch.device(device)
    graphed = device.type == "cuda" if graphed is None else graphed
    if graphed and device.type != "cuda":
        raise RuntimeError(f"fake_fill.replay_ms: graphed=True needs a CUDA device; got {device}")
    counts: dict = {}
    for kind, out_shape, in_shape, dtype, _, *by in records:
        key = (kind, out_shape, in_shape, dtype, by[0] if by else "cp_ops")
        counts[key] = counts.get(key, 0) + 1
    work = []
    for (kind, out_shape, in_shape, dtype, by), n in counts.items():
        inp = torch.randn(in_shape, device=device).to(dtype) if dtype.is_floating_point else \
            torch.ones(in_shape, device=device, dtype=dtype)
        work.append((kind, torch.empty(out_shape, device=device, dtype=dtype), inp, n, by))

    def run():
        for kind, out, inp, n, by in work:
            for _ in range(n):
                if by == "torch":
                    _write_as_torch(out, inp)
                else:
                    _write(kind, out, inp)

    if not work:
        return 0.0
    with torch.no_grad():
        return time_ms(Graphed(run, device, warmup=1) if graphed else run, device, 1, repeats)
