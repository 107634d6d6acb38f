"""A whole diffusers pipeline under context parallelism in one call: :func:`parallelize_pipeline` (docs/pipelines.md).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from ... import config
from ...contract import agree, input_checksum, waiting_in
from ...group import resolve_group
from ...mesh import is_mesh
from . import _private
from .install import parallelize
from .lanes import attach_pipeline
from .planner import plan_pipeline
from .registry import SUPPORTED


def is_transformer(module: Any) -> bool:
    """Whether :func:`~.install.parallelize` takes ``module``: a class with a registry line or a ``_cp_plan``."""
    return isinstance(module, torch.nn.Module) and (
        type(module).__name__ in SUPPORTED or bool(_private.class_cp_plan(type(module))))


def local_device() -> torch.device:
    """``cuda:LOCAL_RANK`` where CUDA is available (``LOCAL_RANK`` unset: 0), else the CPU. ValueError: a
    ``LOCAL_RANK`` that is not an integer or names no visible GPU."""
    raw = os.environ.get("LOCAL_RANK", "0")
    try:
        local = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer (torchrun sets it); got {raw!r}") from None
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if not 0 <= local < torch.cuda.device_count():
        raise ValueError(f"LOCAL_RANK={local} names no visible GPU ({torch.cuda.device_count()} visible); launch at "
                         "most one rank per GPU (torchrun --nproc-per-node <= GPUs)")
    return torch.device("cuda", local)


def _device(device) -> torch.device:
    """``parallelize_pipeline``'s ``device``: None = :func:`local_device`; ``'cuda'`` = ``cuda:LOCAL_RANK``.
    ValueError: a CUDA device without CUDA, or a bad ``LOCAL_RANK``."""
    if device is None:
        return local_device()
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"parallelize_pipeline(device={device!r}): CUDA is not available here: pass device='cpu', "
                             "or None (cuda:LOCAL_RANK where CUDA is, else the CPU)")
        if dev.index is None:
            dev = local_device()
    return dev


def _words(x, depth: int = 0) -> str:
    """A pipeline call's argument in words equal on two ranks exactly when they passed the same value: plain values
    by ``repr``; tensors, arrays, images and generators by shape or device and a digest; functions by name;
    containers item by item; any other object by its type."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    if isinstance(x, torch.Tensor):
        return f"tensor{list(x.shape)} {str(x.dtype).replace('torch.', '')} sum {input_checksum(x):x}"
    if isinstance(x, torch.Generator):
        state = x.get_state()
        return f"generator({x.device}) state {hashlib.blake2b(state.numpy().tobytes(), digest_size=8).hexdigest()}"
    if depth < 4 and isinstance(x, (list, tuple)):
        return "[" + ", ".join(_words(v, depth + 1) for v in x) + "]"
    if depth < 4 and isinstance(x, dict):
        items = sorted(x.items(), key=lambda kv: repr(kv[0]))
        return "{" + ", ".join(f"{k!r}: {_words(v, depth + 1)}" for k, v in items) + "}"
    shape = getattr(x, "shape", None) or getattr(x, "size", None)
    if hasattr(x, "tobytes") and isinstance(shape, tuple):  # a numpy array, a PIL image
        return (f"{type(x).__name__}{list(shape)} "
                f"{hashlib.blake2b(x.tobytes(), digest_size=8).hexdigest()}")
    if callable(x):
        return f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', type(x).__name__)}"
    return type(x).__name__


def _agree_call(pipe, group, n: int, args: tuple, kwargs: dict) -> None:
    """ValueError on every rank of ``group`` naming the arguments of the ``n``-th ``pipe(...)`` that differ."""
    mine = {f"positional argument {i}": _words(a) for i, a in enumerate(args)}
    mine.update({k: _words(v) for k, v in kwargs.items()})
    what = f"{type(pipe).__name__}(...) call #{n} (parallelize_pipeline)"
    with waiting_in(what):
        seen = [json.loads(v) for v in agree(group, "pipeline call", json.dumps(mine), f"the arguments of {what}")]
    differ = sorted({k for d in seen for k in d if any(e.get(k, "not given") != d.get(k, "not given") for e in seen)})
    if not differ:
        return
    shown = "; ".join(f"{k} (" + ", ".join(f"rank {r}: {d.get(k, 'not given')[:80]}" for r, d in enumerate(seen))
                      + ")" for k in differ[:4])
    raise ValueError(f"{what}: the ranks passed different arguments: {', '.join(differ)}. Every rank must make the "
                     "same pipe(...) call (the same arguments, generators seeded alike).\n  " + shown)


def check_calls(pipe, group) -> None:
    """Make each ``pipe(...)`` call first check that every rank of ``group`` passed the same arguments
    (:func:`_agree_call`), so ranks that differ raise before any forward instead of pairing different forwards.
    ``pipe``'s class becomes a same-named subclass."""
    cls = type(pipe)
    if getattr(cls, "_cp_ops_checks_calls", False):
        return
    calls = [0]

    def __call__(self, *args, **kwargs):
        calls[0] += 1
        _agree_call(self, group, calls[0], args, kwargs)
        return cls.__call__(self, *args, **kwargs)

    pipe.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_cp_ops_checks_calls": True,
                                                 "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _init_group(device: torch.device) -> None:
    """torch.distributed from torchrun's environment (NCCL on CUDA, else gloo; cp_ops' timeout), else a group of one."""
    if dist.is_initialized():
        return
    for k, v in config.SAFE_ENV.items():  # multicast/NVLS off wherever cp_ops starts ranks
        os.environ.setdefault(k, v)
    kw: dict[str, Any] = dict(timeout=datetime.timedelta(seconds=config.settings.timeout_s))
    if device.type == "cuda":
        kw["device_id"] = device
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        kw.update(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kw)


def _plan(pipe, model, group, dev: torch.device, mode: str, kwargs: dict):
    """The planned layout (:func:`.planner.plan_pipeline`) over ``group``'s ranks (None for a mesh); ranks per
    node: torchrun's ``LOCAL_WORLD_SIZE``, else every rank."""
    if is_mesh(group):
        return None
    n = resolve_group(group).size()
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return plan_pipeline(pipe, model, n, ranks_per_node=int(local) if local.isdigit() else None,
                         cuda=dev.type == "cuda", mode=mode, cfg_parallel=kwargs.get("cfg_parallel"),
                         compile=kwargs.get("compile", False), cuda_graphs=kwargs.get("cuda_graphs", "auto"))


def parallelize_pipeline(pipe: Any, group: Any = None, *, device: torch.device | str | None = None, mode: str = "auto",
                         transport: str = "auto", chunks: int | None = None, comm_dtype: Any = None,
                         **kwargs: Any) -> Any:
    """Make every transformer of a diffusers pipeline run context-parallel, in place; returns ``pipe``.

    What it does and checks: docs/pipelines.md ("A whole pipeline in one line"): the device, torch.distributed (from
    torchrun's environment; a plain ``python`` run gets a group of one rank), ``pipe.to(device)``, the planned layout
    where none is given (:mod:`.planner`), then :func:`~cp_ops.integrations.diffusers.parallelize` on every supported
    transformer. Sets ``pipe.cp_ops_layout`` (the :class:`.planner.Plan`, None on a mesh), ``cp_ops_writes_output``
    (True on global rank 0) and ``cp_ops_transformers``. Every ``pipe(...)`` call first compares its arguments over
    the ranks (ValueError on every rank naming those that differ).

    Args:
        pipe: a ``diffusers.DiffusionPipeline`` (anything with ``components`` and ``to``).
        group: the CP group (None = every rank; a ProcessGroup or 1-D DeviceMesh).
        device: where the pipeline runs; None = :func:`local_device`.
        mode, transport, chunks, comm_dtype: as :func:`~cp_ops.integrations.diffusers.parallelize`'s (``comm_dtype``:
            None, ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` or ``'e4m3'`` / ``'e5m2'``, a dict per q/k/v/o).
        **kwargs: passed on to ``parallelize`` (``cfg_parallel``, ``compile``, ``cuda_graphs``, ...); with
            ``cfg_parallel=True`` a per-branch pipeline runs its two calls on the two lanes (:mod:`.lanes`). A given
            ``cfg_parallel``, ``mode`` or mesh wins over the plan.

    Raises:
        ValueError: no supported transformer (the message lists the components); transformers already parallelized
            alongside others that are not, or with layout arguments (a ``from_pipe`` pipeline: call
            ``parallelize_pipeline(pipe)`` bare); bad ``LOCAL_RANK``; a CUDA ``device`` without CUDA; anything
            ``parallelize`` raises.
        RuntimeError: torch.distributed cannot start.
    """
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        raise ValueError(f"parallelize_pipeline takes a diffusers pipeline (a .components dict); got "
                         f"{type(pipe).__name__}")
    names = sorted(n for n, m in components.items() if is_transformer(m))
    if not names:
        raise ValueError(
            f"{type(pipe).__name__} has no transformer cp_ops supports: components "
            f"{ {n: type(m).__name__ for n, m in components.items()} }; supported: {tuple(SUPPORTED)} and every class "
            "with a diffusers _cp_plan")
    shared = [n for n in names if getattr(components[n], "_cp_ops_group", None) is not None]
    if shared:  # a pipeline made from a parallelized one (from_pipe, or built from its components)
        given = {k: v for k, v in dict(group=group, device=device, transport=transport, chunks=chunks,
                                       comm_dtype=comm_dtype, **kwargs).items() if v not in (None, "auto")}
        if len(shared) != len(names) or given or mode != "auto":
            head = (f"{type(pipe).__name__}'s transformers {shared} are already parallelized (this pipeline shares "
                    "them with one parallelize_pipeline ran on: from_pipe)")
            raise ValueError(f"{head}; {sorted(set(names) - set(shared))} are not" if len(shared) != len(names) else
                             f"{head}: call parallelize_pipeline(pipe) with no layout arguments to run this pipeline "
                             f"on them as they are; got {sorted(given) or ['mode']}")
        pipe.to(components[names[0]].device if hasattr(components[names[0]], "device") else _device(None))
        pipe.cp_ops_layout = getattr(components[names[0]], "_cp_ops_layout", None)
    else:
        dev = _device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        _init_group(dev)
        pipe.to(dev)
        pipe.cp_ops_layout = _plan(pipe, components[names[0]], group, dev, mode, kwargs)
        if pipe.cp_ops_layout is not None:
            kwargs.setdefault("cfg_parallel", pipe.cp_ops_layout.cfg_parallel)  # a given cfg_parallel wins
        for name in names:
            parallelize(components[name], group, mode=mode, transport=transport, chunks=chunks,
                        comm_dtype=comm_dtype, **kwargs)
            components[name]._cp_ops_layout = pipe.cp_ops_layout
    attach_pipeline(pipe, [components[n] for n in names])  # CFG lanes: a pipeline's per-branch calls paired
    check_calls(pipe, components[names[0]]._cp_ops_input_group)
    pipe.cp_ops_transformers = tuple(names)
    pipe.cp_ops_writes_output = dist.get_rank() == 0
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=dist.get_rank() != 0)
    return pipe
