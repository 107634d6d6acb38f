"""Timing for benchmarks: CUDA events on GPU (perf_counter on CPU), warm-up, median, max over ranks."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` runs after ``warmup`` runs.

    On CUDA each run is bracketed by CUDA events on the current stream, so the time is GPU time of the
    work ``fn`` enqueues (including waits on communication it enqueues).
    """
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def max_over_ranks(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The maximum of ``value`` over the ranks of ``group`` (every rank gets it)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())
