"""A whole diffusers pipeline under context parallelism in one call: :func:`parallelize_pipeline`.

Run the same script on every rank (``torchrun --nproc-per-node W script.py``): each rank loads the pipeline, calls
``parallelize_pipeline(pipe)`` and runs the same ``pipe(...)`` call with the same seeded generator. The text encoders,
scheduler and VAE run in full on every rank; inside each transformer the tokens are split over the ranks
(:func:`~cp_ops.integrations.diffusers.parallelize`), and every rank ends with the same output. Rank 0 writes it
(``pipe.cp_ops_writes_output``).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from . import _private
from .registry import SUPPORTED


def is_transformer(module: Any) -> bool:
    """Whether :func:`~cp_ops.integrations.diffusers.parallelize` takes ``module``: a class with a registry line or a
    diffusers ``_cp_plan``."""
    return isinstance(module, torch.nn.Module) and (
        type(module).__name__ in SUPPORTED or bool(_private.class_cp_plan(type(module))))


def local_device() -> torch.device:
    """``cuda:LOCAL_RANK`` where CUDA is available (``LOCAL_RANK`` unset: 0), else the CPU.

    Raises:
        ValueError: ``LOCAL_RANK`` is not an integer, or names a GPU that is not visible.
    """
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


def _init_group(device: torch.device) -> None:
    """torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): NCCL on CUDA,
    gloo on the CPU, cp_ops' timeout; without that environment a group of one rank (a plain ``python`` run)."""
    if dist.is_initialized():
        return
    from ... import config
    from ...config import SAFE_ENV  # multicast/NVLS off wherever cp_ops starts ranks

    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    timeout = datetime.timedelta(seconds=config.settings.timeout_s)
    kw: dict[str, Any] = dict(timeout=timeout)
    if device.type == "cuda":
        kw["device_id"] = device
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        kw.update(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kw)


def parallelize_pipeline(pipe: Any, group: Any = None, *, device: torch.device | str | None = None, mode: str = "auto",
                         transport: str = "auto", chunks: int | None = None, comm_dtype: Any = None,
                         **kwargs: Any) -> Any:
    """Make every transformer of a diffusers pipeline run context-parallel, in place; returns ``pipe``.

    Steps: the device (``device``, else :func:`local_device`: ``cuda:LOCAL_RANK`` or the CPU; on CUDA also
    ``torch.cuda.set_device``); torch.distributed (initialized from torchrun's environment where it is not yet: NCCL
    on CUDA, gloo on the CPU; a plain ``python`` run gets a group of one rank); ``pipe.to(device)``; then
    :func:`~cp_ops.integrations.diffusers.parallelize` on every component that is a supported transformer
    (``transformer``, and ``transformer_2`` where the pipeline has one, as Wan 2.2 A14B's two experts; a component
    that is None is skipped). Sets ``pipe.cp_ops_writes_output`` (True on global rank 0 only: the rank that should
    save the result) and ``pipe.cp_ops_transformers`` (the component names parallelized), and shows the pipeline's
    progress bar on rank 0 only.

    Every rank must then make the same ``pipe(...)`` call with the same inputs: pass a generator seeded alike on every
    rank (``torch.Generator().manual_seed(0)``) so the initial noise agrees (a mismatch raises on every rank at the
    first forward, naming the input).

    Args:
        pipe: a ``diffusers.DiffusionPipeline`` (anything with ``components`` and ``to``).
        group: the CP group (None = every rank; a ProcessGroup or 1-D DeviceMesh).
        device: where the pipeline runs; None = :func:`local_device`.
        mode, transport, chunks: as :func:`~cp_ops.integrations.diffusers.parallelize`.
        comm_dtype: what every CP attention call of every transformer sends over the link, as
            :func:`~cp_ops.integrations.diffusers.parallelize`'s (None = the model's dtype; ``torch.float8_e4m3fn`` /
            ``torch.float8_e5m2`` or ``'e4m3'`` / ``'e5m2'``; a dict per tensor q/k/v/o; docs/fp8.md).
        **kwargs: passed on to :func:`~cp_ops.integrations.diffusers.parallelize` for every transformer
            (``cfg_parallel``, ``compile``, ``cuda_graphs``, ...).

    Raises:
        ValueError: ``pipe`` has no component :func:`~cp_ops.integrations.diffusers.parallelize` supports (the message
            lists the components); a transformer already parallelized; bad ``LOCAL_RANK``; anything
            :func:`~cp_ops.integrations.diffusers.parallelize` raises.
        RuntimeError: torch.distributed cannot start.
    """
    from .install import parallelize

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
    dev = torch.device(device) if device is not None else local_device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    _init_group(dev)
    pipe.to(dev)
    for name in names:
        parallelize(components[name], group, mode=mode, transport=transport, chunks=chunks, comm_dtype=comm_dtype,
                    **kwargs)
    pipe.cp_ops_transformers = tuple(names)
    pipe.cp_ops_writes_output = dist.get_rank() == 0
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=dist.get_rank() != 0)
    return pipe
