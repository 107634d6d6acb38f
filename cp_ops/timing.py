"""Timing for the bench, ``cp-ops run`` and the measured mode choice (:mod:`cp_ops.modes.tune`): CUDA events on GPU (perf_counter on CPU), warm-up, median and spread, max over ranks.

Two ways to time a call: :func:`steady_ms` (N calls back to back between two CUDA events, the host running
ahead as consecutive layers of a model run: the time per call a model sees) and :func:`samples_ms` (each call
bracketed and waited for on its own: the latency of one call, host launch cost included)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` runs after ``warmup`` runs (see :func:`samples_ms`)."""
    return statistics.median(samples_ms(fn, device, warmup, repeats))


def summary(samples: list[float]) -> dict:
    """``{'median', 'min', 'max', 'q1', 'q3'}`` of ``samples`` (ms); q1/q3 are the 25th/75th percentiles
    (linear interpolation; a single sample gives that value for all five)."""
    xs = sorted(samples)
    if len(xs) == 1:
        return dict(median=xs[0], min=xs[0], max=xs[0], q1=xs[0], q3=xs[0])
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return dict(median=statistics.median(xs), min=xs[0], max=xs[-1], q1=q1, q3=q3)


def samples_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Wall time of each of ``repeats`` runs of ``fn()`` in ms, after ``warmup`` untimed runs.

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
    return times


def steady_ms(fn: Callable[[], object], device: torch.device, warmup: int, samples: int, calls: int,
              align: dist.ProcessGroup | bool = False) -> list[float]:
    """Steady-state time per call, ms, of each of ``samples`` samples: ``calls`` runs of ``fn()`` back to back
    between two CUDA events on the current stream (no host wait in between: the host runs ahead), divided by
    ``calls``; after ``warmup`` untimed runs. The device is synchronized before each sample (its queue empty).
    On CPU: ``time.perf_counter`` around the ``calls`` runs. ``align``: a process group (``True``: the default
    group) whose ranks meet in a barrier before each sample, so every rank's sample starts together."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(samples):
        if align:
            dist.barrier(group=None if align is True else align)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return times


def max_over_ranks(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The maximum of ``value`` over the ranks of ``group`` (every rank gets it)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def max_over_ranks_each(values: list[float], device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks of ``group`` (same length on every rank): the time of
    the i-th CP call is the slowest rank's."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()
