"""Whole-forward CUDA-graph capture of a module's call: ``module(*args, **kwargs)``, its hooks included, one CUDA
graph per call signature, replayed with no host work (``parallelize(..., cuda_graphs="forward")``; any module whose
forward a CUDA graph can record). The rules — the key, cloned outputs, arguments written in place, ``max_keys``, what
cannot be captured, the ranks' agreement, the class swap — and measurements: ``docs/diffusers_compile_caches.md``
("Whole-forward capture"). Tests without a GPU replace :data:`BACKEND` (see :class:`CudaGraphs`).
"""

from __future__ import annotations

import collections
import enum
import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from .transport import base as transport_base


def warm_on_side_stream(fn: Callable[[], object], n: int, device: torch.device) -> None:
    """``n`` calls of ``fn()`` on a side stream ordered with the current one: the warm-up torch asks before a
    ``torch.cuda.graph`` capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(n):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)


def failed_ranks(group: dist.ProcessGroup | None, reason: str) -> list[tuple[int | None, str]]:
    """``[(rank, reason)]`` of the ranks whose step failed (``reason``: this rank's, ``''``: succeeded), gathered over
    ``group`` (every rank calls); one rank, a fake group or None: this process's outcome alone (rank None for None)."""
    if group is not None and group.size() > 1 and str(dist.get_backend(group)) != "fake":
        reasons: list = [None] * group.size()
        dist.all_gather_object(reasons, reason, group=group)
        return [(r, x) for r, x in enumerate(reasons) if x]
    return [(None if group is None else group.rank(), reason)] if reason else []


#: instance attribute holding a captured module's :class:`CapturedForward`
ATTR = "_cp_ops_captured"
#: default cap on live keys per captured module (least recently used evicted past it)
MAX_KEYS = 8


class CudaGraphs:
    """The real mechanism (torch.cuda.graph). Replaceable as :data:`BACKEND` (the same four methods) for tests."""

    def check(self, device: torch.device) -> None:
        """Raise ValueError when ``device`` cannot record CUDA graphs."""
        if device.type != "cuda":
            raise ValueError(f"whole-forward CUDA-graph capture needs CUDA (a CUDA graph records GPU work); the "
                             f"model's parameters are on {device}")
        if not torch.cuda.is_available():
            raise ValueError("whole-forward CUDA-graph capture needs CUDA; torch.cuda.is_available() is False")

    def pool(self, device: torch.device):
        return torch.cuda.graph_pool_handle()

    def warmup(self, fn: Callable[[], Any], n: int, device: torch.device) -> None:
        """``n`` calls on a side stream, as torch's rule for capture asks."""
        warm_on_side_stream(fn, n, device)

    def capture(self, fn: Callable[[], Any], pool, device: torch.device) -> tuple[Callable[[], None], Any]:
        """Record one call of ``fn``; returns ``(replay, outputs)`` (the outputs are rewritten by each replay)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph.replay, out


#: the graph mechanism every capture uses (tests replace it)
BACKEND: Any = CudaGraphs()


class CaptureError(RuntimeError):
    """A capture (or its warm-up) failed on some rank; raised on every rank. ``stage``: where the first failing rank
    failed (``'warm-up'``, ``'capture'``, ``'outputs'``)."""

    def __init__(self, message: str, stage: str = "capture"):
        super().__init__(message)
        self.stage = stage


class _Entry:
    """One key's graph: its static inputs, its replay, its outputs' leaves and structure (flattened once)."""
    __slots__ = ("statics", "replay", "out_leaves", "out_spec", "mutated")

    def __init__(self, statics, replay, out, mutated=()):
        self.statics, self.replay = statics, replay
        self.out_leaves, self.out_spec = pytree.tree_flatten(out)
        self.mutated = tuple(mutated)  # argument leaves the forward writes in place: copied back after each replay


#: non-tensor output leaves a replay may return as they are (immutable values: the same object each call is fine)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.Size)


def check_outputs(out) -> None:
    """Raise ValueError when a forward's output holds a leaf a replay cannot return afresh: anything but tensors,
    immutable values and pytree containers."""
    for i, x in enumerate(pytree.tree_leaves(out)):
        if not isinstance(x, (torch.Tensor, *_PLAIN)) and not isinstance(x, enum.Enum):
            raise ValueError(
                f"output leaf {i} is a {type(x).__module__}.{type(x).__qualname__}, not a tensor, an immutable value "
                "or a pytree container: a replay would return that same object each call, its tensors overwritten "
                "by the next call (rule: a captured forward returns tensors, None/numbers/str, or tuples, lists, "
                "dicts, namedtuples, diffusers outputs of them). Register its class as a pytree node "
                "(torch.utils._pytree.register_dataclass for a dataclass) or return a tuple/dict")


def _hashable(x):
    try:
        hash(x)
        return x
    except TypeError:
        return str(x)  # a TreeSpec that is not hashable on this torch: its text (types, keys, structure)


def _key(leaves: list, spec) -> tuple:
    parts = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            parts.append(("T", tuple(x.shape), x.dtype, x.device, tuple(x.stride())))
        else:
            try:
                hash(x)
            except TypeError:
                raise ValueError(f"captured forward: argument leaf {i} (in call order) is a {type(x).__name__}, "
                                 "which is not hashable; a captured call's non-tensor arguments are part of its "
                                 "key (pass tensors, numbers, strings, None, or containers of them)") from None
            # a NaN equals nothing, not even itself: its key part a name, else every call would capture anew
            parts.append(("V", type(x), "nan" if isinstance(x, float) and x != x else x))
    return (_hashable(spec), tuple(parts), torch.is_grad_enabled(), torch.is_inference_mode_enabled())


def call_key(args: tuple, kwargs: dict) -> tuple:
    """The key of a call ``(args, kwargs)`` (docs/diffusers_compile_caches.md). Raises ValueError for a non-tensor
    leaf that is not hashable."""
    return _key(*pytree.tree_flatten((args, kwargs)))


#: model functions known not to be capturable: innermost frame's function -> why (added to the error)
KNOWN = {
    "compute_text_seq_len_from_mask": "diffusers' Qwen-Image (0.42.1) computes the text length with "
                                      "torch.as_tensor(int, device=cuda): a copy from pageable host memory; "
                                      "cp_ops.integrations.diffusers.capture_safe.apply(model) replaces it "
                                      "(parallelize(cuda_graphs='forward') does)",
}


def _model_frame(tb) -> tuple[str, str]:
    """The innermost traceback frame outside torch and this file: ``('path:line in func', func)`` (empty if none)."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    here = os.path.abspath(__file__)
    for fr in reversed(traceback.extract_tb(tb)):
        f = os.path.abspath(fr.filename)
        if not f.startswith(torch_dir + os.sep) and f != here:
            return f"{fr.filename}:{fr.lineno} in {fr.name}", fr.name
    return "", ""


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _reason(stage: str, e: BaseException) -> str:
    """``'<stage>: <Type>: <first line> (at <model frame>)[ (then: ...)][; known: ...]'`` of the exception that
    started the failure (the root of ``e``'s cause/context chain)."""
    chain = [e]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    root = chain[-1]
    where, func = _model_frame(root.__traceback__)
    known = KNOWN.get(func)
    return (f"{stage}: {_first_line(root)}" + (f" (at {where})" if where else "")
            + (f" (then: {_first_line(e)})" if root is not e else "") + (f"; known: {known}" if known else ""))


def failure_message(what: str, bad: list[tuple[int | None, str]]) -> str:
    """The error of a failed capture: ``bad`` = ``[(rank or None, reason)]`` of the failing ranks, first first."""
    rank, why = bad[0]
    who = "" if rank is None else f" on rank(s) {[r for r, _ in bad]}; rank {rank}'s reason"
    if why.startswith("outputs"):
        return f"{what}: the forward's outputs cannot be returned by a replay{who}: {why}"
    if why.startswith("warm-up"):
        return (f"{what}: the eager warm-up calls before the whole-forward CUDA-graph capture failed{who}: {why}. "
                "The forward itself fails on these inputs (uncaptured, it would too)")
    return (f"{what}: the whole-forward CUDA-graph capture failed{who}: {why}. The forward does something a CUDA "
            "graph cannot record (a host sync such as .item() or a data-dependent branch, a copy from pageable "
            "host memory such as torch.as_tensor(number, device='cuda'), a step cache's decision). Use per-block "
            "graphs instead (parallelize(..., compile=True, cuda_graphs=True): mode='reduce-overhead' per block), "
            "or no graphs")


def _agree(group, reason: str, what: str) -> None:
    """Every rank of ``group`` learns every rank's ``reason`` ('' = success); CaptureError on every rank when any
    failed."""
    bad = failed_ranks(group, reason)
    if bad:
        raise CaptureError(failure_message(what, bad), bad[0][1].split(":", 1)[0])


class CapturedForward:
    """The per-key graphs of one module's call (docs/diffusers_compile_caches.md): ``__call__`` returns what the module
    returns (tensors cloned and detached unless ``clone_outputs=False``); ``captures``, ``evictions``, :meth:`keys`."""

    def __init__(self, module: torch.nn.Module, call: Callable[..., Any], device: torch.device, *, group=None,
                 warmup: int = 2, clone_outputs: bool = True, max_keys: int = MAX_KEYS, what: str = "",
                 fallback: Callable[[str], None] | None = None,
                 refuse: Callable[[torch.nn.Module], str | None] | None = None):
        self.module, self._call, self.device, self.group = module, call, device, group
        self.warmup, self.clone_outputs, self.max_keys = warmup, clone_outputs, max_keys
        self.what = what or f"captured {type(module).__name__}"
        self.fallback, self.refuse = fallback, refuse
        self.eager_why: str | None = None  # with a fallback: why every call now runs eager (None: capturing)
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._pool = None
        self.captures = self.evictions = 0

    def go_eager(self, why: str) -> None:
        """With a ``fallback``: every later call runs the module's call eagerly, the graphs freed; ``fallback(why)``
        is told once."""
        if self.eager_why is None:
            self.eager_why = why
            self._entries.clear()
            self.fallback(why)

    def keys(self) -> list:
        return list(self._entries)

    def __deepcopy__(self, memo):
        """A copy of a captured module captures afresh (its own graphs, pool and static inputs; none copied)."""
        import copy

        module = copy.deepcopy(self.module, memo)  # the module being copied (memo): this is its __dict__ entry
        return CapturedForward(module, self._call.__func__.__get__(module), self.device, group=self.group,
                               warmup=self.warmup, clone_outputs=self.clone_outputs, max_keys=self.max_keys,
                               what=self.what, fallback=self.fallback, refuse=self.refuse)

    def __call__(self, *args, **kwargs):
        if self.fallback is not None and (self.eager_why is not None or torch.compiler.is_compiling()):
            return self._call(*args, **kwargs)  # gone eager, or traced by Dynamo (it compiles the eager call)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = _key(leaves, spec) + (self.group,)  # a graph's collectives run on the group it was captured for
        entry = self._entries.get(key)
        if entry is None and self.fallback is not None:
            why = self.refuse(self.module) if self.refuse is not None else None
            if why is None:
                try:
                    entry = self._capture(key, leaves, spec)
                except CaptureError as e:
                    if e.stage == "warm-up":  # the forward itself fails on these inputs: eager raises its error
                        return self._call(*args, **kwargs)
                    why = str(e)
            if why is not None:
                self.go_eager(why)
                return self._call(*args, **kwargs)
        elif entry is None:
            if self.refuse is not None and (why := self.refuse(self.module)) is not None:
                raise ValueError(f"{self.what}: this call's forward cannot be captured: {why}; remove that, or run "
                                 "the module eagerly (parallelize: cuda_graphs='auto' or False)")
            entry = self._capture(key, leaves, spec)
        else:
            self._entries.move_to_end(key)
            _copy_in(entry.statics, leaves)
        entry.replay()
        transport_base.check_all()  # a device wait that timed out in an earlier replay raises here, not later
        if entry.mutated:  # the forward writes these arguments in place: the caller's tensors get what eager gives
            with torch.no_grad():
                for i in entry.mutated:
                    leaves[i].copy_(entry.statics[i])
        return _outputs(entry.out_leaves, entry.out_spec, self.clone_outputs)

    def _capture(self, key, leaves: list, spec) -> _Entry:
        if len(self._entries) >= self.max_keys:  # every rank calls with the same keys: they evict alike
            self._entries.popitem(last=False)
            self.evictions += 1
        with torch.no_grad():  # plain copies (an input that requires grad gives a static one that does not)
            statics = [torch.empty_like(x).copy_(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        sargs, skwargs = pytree.tree_unflatten(statics, spec)

        def fn():
            return self._call(*sargs, **skwargs)

        mutated: set = set()  # static inputs a warm-up call wrote in place (their version counter moved)

        def probed():
            before = [x._version if isinstance(x, torch.Tensor) else None for x in statics]
            out = fn()
            mutated.update(i for i, (x, v) in enumerate(zip(statics, before)) if v is not None and x._version != v)
            return out

        if self._pool is None:
            self._pool = BACKEND.pool(self.device)
        replay = out = None
        reason = ""
        try:
            stage = "warm-up"
            BACKEND.warmup(probed, self.warmup, self.device)
            # copied again (version counters move on): a memo keyed on an input's version (the every-key mask of
            # cp_ops.integrations.diffusers.hooks.CPState) rebuilds inside the capture, so the graph rebuilds it
            _copy_in(statics, leaves)
            stage = "capture"
            replay, out = BACKEND.capture(fn, self._pool, self.device)
            stage = "outputs"
            check_outputs(out)
        except Exception as e:  # noqa: BLE001 - agreed over the group below, then raised on every rank
            if self.group is None:
                raise CaptureError(failure_message(self.what, [(None, _reason(stage, e))]), stage) from e
            reason = _reason(stage, e)
        if self.group is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            _agree(self.group, reason, self.what)
        entry = _Entry(statics, replay, out, sorted(mutated))
        self._entries[key] = entry
        self.captures += 1
        return entry


def _copy_in(statics: list, leaves: list) -> None:
    with torch.no_grad():
        for s, x in zip(statics, leaves):
            if isinstance(s, torch.Tensor) and s is not x:
                s.copy_(x)


def _outputs(leaves: list, spec, clone: bool):
    return pytree.tree_unflatten([(x.detach().clone() if clone else x.detach()) if isinstance(x, torch.Tensor) else x
                                  for x in leaves], spec)


def _device_of(module: torch.nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    if p is None:
        p = next(module.buffers(), None)
    return p.device if p is not None else torch.device("cpu")


def check_capturable(module: torch.nn.Module) -> None:
    """Raise ValueError when :func:`capture_forward` would refuse ``module`` (not on CUDA; already captured)."""
    if ATTR in module.__dict__:
        raise ValueError(f"this {type(module).__name__} is already captured (cp_ops.captured.uncapture first)")
    BACKEND.check(_device_of(module))


_SUBCLASSES: dict = {}


def _captured_call(self, *args, **kwargs):
    return self.__dict__[ATTR](*args, **kwargs)


def _subclass(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__call__": _captured_call, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "_cp_ops_uncaptured_class": cls})
        _SUBCLASSES[cls] = sub
    return sub


def capture_forward(module: torch.nn.Module, *, group: dist.ProcessGroup | None = None, warmup: int = 2,
                    clone_outputs: bool = True, max_keys: int = MAX_KEYS,
                    fallback: Callable[[str], None] | None = None,
                    refuse: Callable[[torch.nn.Module], str | None] | None = None) -> torch.nn.Module:
    """Make every later ``module(*args, **kwargs)`` run as a CUDA-graph replay of the whole call, hooks included, in
    place (the class swapped for a same-named subclass).

    Args:
        module: on CUDA. group: the ranks whose collectives the forward makes (they agree on each capture's
            outcome); None: this process alone. warmup: eager calls before each capture (>= 1).
        clone_outputs: return clones of the graph's outputs (default); False: the graph's own output tensors, valid
            until the next call with the same key. max_keys: live keys at most (>= 1; LRU eviction past it).
        fallback: None: a failed capture raises. A function: a capture that fails (agreed over ``group``) or that
            ``refuse(module)`` refuses (a reason; asked before each new key's capture) turns the module eager for
            good and calls ``fallback(reason)`` once; a failed warm-up runs that call eagerly (its own error); a call
            traced by Dynamo runs eagerly too. Without a fallback, a key ``refuse`` refuses raises ValueError.
    Returns: ``module``. Its calls return what the module returns (tensors detached; cloned by default).
    Raises:
        ValueError: not on CUDA, already captured, ``warmup`` < 1 or ``max_keys`` < 1; at call time a non-tensor
            argument leaf that is not hashable, or a new key ``refuse`` refuses (no ``fallback``).
        CaptureError (a RuntimeError): at a new key's first call, the warm-up or capture failed, or the outputs hold
            an object a replay cannot return afresh (with ``group``: on any rank, raised on every rank).
    """
    if not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"capture_forward: warmup must be an int >= 1 (torch's rule: warm up before capture); "
                         f"got {warmup!r}")
    if not isinstance(max_keys, int) or max_keys < 1:
        raise ValueError(f"capture_forward: max_keys must be an int >= 1; got {max_keys!r}")
    check_capturable(module)
    cls = type(module)
    call = cls.__call__.__get__(module, cls)  # nn.Module.__call__: hooks, then forward (also an instance forward)
    module.__dict__[ATTR] = CapturedForward(module, call, _device_of(module), group=group, warmup=warmup,
                                            clone_outputs=clone_outputs, max_keys=max_keys,
                                            what=f"captured {cls.__name__}", fallback=fallback, refuse=refuse)
    module.__class__ = _subclass(cls)
    return module


def captured(module: torch.nn.Module) -> CapturedForward | None:
    """The module's :class:`CapturedForward`, or None when it is not captured."""
    return module.__dict__.get(ATTR)


def uncapture(module: torch.nn.Module) -> None:
    """Undo :func:`capture_forward` (the class restored, the graphs freed). No-op on a module not captured."""
    if module.__dict__.pop(ATTR, None) is not None:
        module.__class__ = type(module)._cp_ops_uncaptured_class
