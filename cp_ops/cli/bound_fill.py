"""The bound tool's process groups: fake groups whose collectives write their outputs.

``cp-ops bound`` times rank 0 of a W-rank *fake* process group. torch 2.11's fake backend leaves ``alltoall_base``'s
output unwritten, and kernels on stale memory ran 13-15 % faster than on real values (``docs/measuring.md``), so these
groups write every output themselves: this rank's own data in every source slot. :func:`filled` swaps the creator of
torch's ``'fake'`` backend, so each group made is a :class:`FilledFakeGroup` (a Python ``ProcessGroup`` with torch's
fake backend under it for everything else, still named ``'fake'``): every path that moves data through it, compiled
or eager, cp_ops' or diffusers', gets its outputs written. Each write is one device copy: :func:`recording` lists
them and :func:`replay_ms` times the same copies alone.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_records: list | None = None
_done = None
#: Python ProcessGroup classes Dynamo is told to trace as groups (:func:`let_dynamo_trace`)
_traced: list[type] = []


def completed_work():
    """A completed c10d work (``wait()`` returns at once), made once: a Python group's synchronous collective's."""
    global _done
    if _done is None:
        fut = torch.futures.Future()
        fut.set_result(None)
        _done = torch._C._distributed_c10d._create_work_from_future(fut)
    return _done


def _write(out: torch.Tensor, inp: torch.Tensor) -> None:
    """``inp`` into every slot of ``out``: a copy for equal shapes, every dim-0 chunk when ``out`` holds a whole number
    of ``inp``'s, else ``inp``'s elements repeated to ``out``'s size (uneven all-to-all splits)."""
    if out.shape == inp.shape:
        out.copy_(inp)
    elif out.dim() and inp.dim() and out.shape[1:] == inp.shape[1:] and inp.shape[0] and \
            out.shape[0] % inp.shape[0] == 0:
        out.view(out.shape[0] // inp.shape[0], *inp.shape).copy_(inp)
    else:
        flat = inp.reshape(-1)
        reps = -(-out.numel() // max(1, flat.numel()))
        out.copy_(flat.repeat(reps)[: out.numel()].view(out.shape))


class FilledFakeGroup(dist.ProcessGroup):
    """A fake process group whose data collectives write this rank's data into every source slot of their outputs
    (one copy per output tensor) and return a completed work; every other call goes to torch's fake backend,
    registered under it for CPU and CUDA tensors. ``recv`` writes the last tensor this group sent with the same tag
    and shape (cp_ops' point-to-point gather sends its own block before each receive)."""

    def __init__(self, inner, rank: int, size: int):
        super().__init__(rank, size)
        self._sent: dict = {}
        for dev in ("cpu", "cuda"):
            self._register_backend(torch.device(dev), dist.ProcessGroup.BackendType.CUSTOM, inner)

    def getBackendName(self):
        return "fake"

    def _fill(self, kind: str, out: torch.Tensor, inp: torch.Tensor) -> None:
        if _records is not None:
            _records.append((kind, tuple(out.shape), tuple(inp.shape), out.dtype, out.device))
        with torch.no_grad():
            _write(out, inp)

    def alltoall_base(self, out, inp, out_splits, in_splits, opts=None):
        self._fill("alltoall_base", out, inp)
        return completed_work()

    def _allgather_base(self, out, inp, opts=None):
        self._fill("_allgather_base", out, inp)
        return completed_work()

    all_gather_single = _allgather_base  # torch >= 2.13's name of dist.all_gather_into_tensor's call

    def allgather_into_tensor_coalesced(self, outs, ins, opts=None):
        for out, inp in zip(outs, ins):
            self._fill("allgather_into_tensor_coalesced", out, inp)
        return completed_work()

    def allgather(self, outs, ins, opts=None):
        for chunks, inp in zip(outs, ins):
            for out in chunks:
                self._fill("allgather", out, inp)
        return completed_work()

    def send(self, tensors, dst, tag):
        for t in tensors:
            self._sent[(tag, tuple(t.shape))] = t
        return completed_work()

    def recv(self, tensors, src, tag):
        for t in tensors:
            sent = self._sent.pop((tag, tuple(t.shape)), None)
            if sent is not None:
                self._fill("recv", t, sent)
        return completed_work()


def let_dynamo_trace(cls: type) -> None:
    """Let ``torch.compile`` trace instances of ``cls`` (a Python ``ProcessGroup`` subclass) as process groups: Dynamo
    before torch 2.13 takes only the exact classes (``type(g) is ...``) and fails on a subclass's ``size()``; its check
    is widened, once, to the classes named here. Later Dynamo needs nothing."""
    if cls not in _traced:
        _traced.append(cls)
    try:
        from torch._dynamo.variables.distributed import ProcessGroupVariable
    except ImportError:
        return
    check = getattr(ProcessGroupVariable, "is_process_group", None)
    if check is None or getattr(check, "takes_python_groups", False):
        return

    def is_process_group(value) -> bool:
        return isinstance(value, tuple(_traced)) or check(value)

    is_process_group.takes_python_groups = True
    ProcessGroupVariable.is_process_group = staticmethod(is_process_group)


@contextlib.contextmanager
def filled():
    """While active, every process group made with backend ``'fake'`` in this process is a :class:`FilledFakeGroup`
    (torch's ``'fake'`` backend creator swapped, and restored on exit; groups made before or after are torch's)."""
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers the 'fake' backend)

    let_dynamo_trace(FilledFakeGroup)
    plugins = dist.Backend._plugins
    torch_fake = plugins["FAKE"]

    def create(common_opts, backend_opts):
        inner = torch_fake.creator_fn(common_opts, backend_opts)
        return FilledFakeGroup(inner, common_opts.group_rank, common_opts.group_size)

    plugins["FAKE"] = dist.Backend._BackendPlugin(create, True)
    try:
        yield
    finally:
        plugins["FAKE"] = torch_fake


def is_filled(group) -> bool:
    return isinstance(group, FilledFakeGroup)


@contextlib.contextmanager
def recording():
    """Yield the list of ``(kind, out_shape, in_shape, dtype, device)`` of the writes a FilledFakeGroup makes inside."""
    global _records
    prev, _records = _records, []
    try:
        yield _records
    finally:
        _records = prev


def replay_ms(records: list, device: torch.device, repeats: int = 5, graphed: bool | None = None) -> float:
    """Device time in ms of the writes ``records`` lists (:func:`recording`), replayed alone on ``device`` on
    standard-normal inputs (one buffer pair per shape): what they add to a forward. ``graphed`` (default: on CUDA):
    captured in one CUDA graph, its replay timed (median of ``repeats``), without the host's launches (hundreds of
    ~3 µs copies are launch-bound: ``docs/measuring.md``); else launched back to back.

    Raises:
        RuntimeError: ``graphed=True`` off CUDA, or the capture failed.
    """
    from ..timing import Graphed, time_ms

    device = torch.device(device)
    graphed = device.type == "cuda" if graphed is None else graphed
    if graphed and device.type != "cuda":
        raise RuntimeError(f"replay_ms: graphed=True needs a CUDA device; got {device}")
    counts: dict = {}
    for _, out_shape, in_shape, dtype, *_ in records:
        key = (out_shape, in_shape, dtype)
        counts[key] = counts.get(key, 0) + 1
    work = []
    for (out_shape, in_shape, dtype), n in counts.items():
        inp = torch.randn(in_shape, device=device).to(dtype) if dtype.is_floating_point else \
            torch.ones(in_shape, device=device, dtype=dtype)
        work.append((torch.empty(out_shape, device=device, dtype=dtype), inp, n))

    def run():
        for out, inp, n in work:
            for _ in range(n):
                _write(out, inp)

    if not work:
        return 0.0
    with torch.no_grad():
        return time_ms(Graphed(run, device, warmup=1) if graphed else run, device, 1, repeats)
