"""Run a test body on W real gloo ranks (separate processes) and re-raise the first rank's failure."""

from __future__ import annotations

import os
import traceback

import torch.multiprocessing as mp

from cp_ops.cli.launch import _worker, free_port


def _body(rank, world_size, device, fn, args, errq):
    try:
        fn(rank, world_size, *args)
        errq.put((rank, None))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        errq.put((rank, traceback.format_exc()))
        raise


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, device: str = "cpu") -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo on CPU, NCCL with one GPU
    each on ``device='cuda'``); raise if any rank fails.

    ``fn`` must be importable (a module-level function of a test module).
    """
    os.environ.setdefault("CP_OPS_TIMEOUT_S", "60")
    ctx = mp.get_context("spawn")
    errq = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, device, port, _body, (fn, args, errq)))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    errors = []
    while not errq.empty():
        rank, err = errq.get()
        if err:
            errors.append(f"--- rank {rank} ---\n{err}")
    if errors:
        raise AssertionError("\n".join(errors))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited non-zero: {bad}")
