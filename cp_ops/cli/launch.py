"""Start W local ranks (or join a torchrun launch) and run a function on each.

Under ``torchrun`` :func:`launch` joins its group; standalone it spawns ``nproc`` processes on a free localhost port.
Backend: NCCL on CUDA, else gloo; ``device=SHARED``: every rank on ``cuda:0`` over gloo with CUDA tensors (NCCL
refuses two ranks on one device). Every group gets ``cp_ops.config.settings.timeout_s``: a collective that cannot
complete raises instead of hanging.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import threading
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cp_ops.ops  # noqa: F401  (every rank this starts has torch.ops.cp_ops.* registered)
from cp_ops import config
from cp_ops.config import SAFE_ENV  # multicast/NVLS off wherever cp_ops starts ranks

from ._args import under_torchrun  # noqa: F401 (main and bound_args import it from here)


#: the device name :func:`launch` takes for ranks that share cuda:0 (``--device shared``)
SHARED = "cuda-shared"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world_size: int, device: str) -> torch.device:
    """Initialize torch.distributed for one rank; returns the rank's device (cuda:local_rank, cuda:0 for
    :data:`SHARED`, or cpu); :func:`launch` has set :data:`SAFE_ENV`."""
    timeout = datetime.timedelta(seconds=config.settings.timeout_s)
    if device == SHARED:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:gloo", rank=rank, world_size=world_size, timeout=timeout)
        return torch.device("cuda", 0)
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timeout, device_id=dev)
        return dev
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    return torch.device("cpu")


#: seconds :func:`shutdown` gives ``destroy_process_group`` before the process exits without it
DESTROY_TIMEOUT_S = 30.0


def shutdown(ok: bool, timeout_s: float = DESTROY_TIMEOUT_S) -> None:
    """End this rank's process group, bounded in time: after NCCL work was captured in CUDA graphs
    ``destroy_process_group`` can wait forever (pytorch/pytorch#115388). So drop Dynamo's caches and CUDA-graph trees,
    synchronize, destroy on a helper thread, and past ``timeout_s`` say so and ``os._exit`` (0 when ``ok``, else 1
    after the pending traceback)."""
    if not dist.is_initialized():
        return
    if "torch._dynamo" in sys.modules and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch._dynamo.reset()  # also resets the CUDA-graph trees (reduce-overhead's captured graphs)
        gc.collect()
        torch.cuda.synchronize()
    done = threading.Thread(target=dist.destroy_process_group, name="cp_ops-destroy", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        if not ok:
            traceback.print_exc()
        print(f"cp_ops: rank {os.environ.get('RANK', '?')}: torch.distributed.destroy_process_group did not return "
              f"within {timeout_s:.0f} s (a known hang after NCCL work was captured in CUDA graphs, "
              "pytorch/pytorch#115388); exiting without it", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0 if ok else 1)


def run_rank(rank: int, world_size: int, device: str, port: int, fn: Callable, args: tuple) -> None:
    """One local rank of a group rendezvousing at 127.0.0.1:``port``: sets the torch.distributed environment,
    initializes the process group (:func:`init_rank`), runs ``fn(rank, world_size, device, *args)`` and shuts the rank
    down (:func:`shutdown`: the process exits 0, or 1 when ``fn`` raised). What :func:`launch` spawns per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["LOCAL_RANK"] = str(rank)
    _run(rank, world_size, device, fn, args)


def _run(rank: int, world_size: int, device: str, fn: Callable, args: tuple) -> None:
    dev = init_rank(rank, world_size, device)
    ok = False
    try:
        fn(rank, world_size, dev, *args)
        ok = True
    finally:
        shutdown(ok)


def launch(fn: Callable[..., Any], nproc: int, device: str, *args: Any) -> None:
    """Run ``fn(rank, world_size, device, *args)`` on every rank (under torchrun: its WORLD_SIZE ranks). Raises
    ValueError when ``nproc < 1`` or ``device='cuda'`` has fewer than ``nproc`` visible GPUs."""
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    if under_torchrun():
        return _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device, fn, args)
    if device == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(f"--nproc {nproc} needs {nproc} visible GPUs; found {torch.cuda.device_count()} "
                         "(lower --nproc or use --device cpu)")
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1; got {nproc}")
    mp.spawn(run_rank, args=(nproc, device, free_port(), fn, args), nprocs=nproc, join=True)
