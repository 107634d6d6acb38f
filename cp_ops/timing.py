"""Timing for the bench, ``cp-ops run`` and the measured mode choice (:mod:`cp_ops.plan.measured`), max over ranks:
:func:`steady_ms` (N calls back to back, the host running ahead as consecutive layers do: the time per call a model
sees) and :func:`samples_ms` (each call waited for on its own: the latency of one call, host launch cost included)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from .captured import failed_ranks, warm_on_side_stream


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
            host: list | None = None) -> float:
    """Median of :func:`samples_ms`."""
    return statistics.median(samples_ms(fn, device, warmup, repeats, host))


def summary(samples: list[float]) -> dict:
    """``{'median', 'min', 'max', 'q1', 'q3'}`` of ``samples`` (q1/q3: inclusive quartiles)."""
    xs = sorted(samples)
    if len(xs) == 1:
        return dict(median=xs[0], min=xs[0], max=xs[0], q1=xs[0], q3=xs[0])
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return dict(median=statistics.median(xs), min=xs[0], max=xs[-1], q1=q1, q3=q3)


def samples_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int,
               host: list | None = None) -> list[float]:
    """Wall time of each of ``repeats`` runs of ``fn()`` in ms, after ``warmup`` untimed runs; on CUDA between events
    on the current stream, each run on an empty queue. ``host`` (a list) gets each ``fn()`` call's host time in ms
    (where it reaches the device time, the run is host-bound)."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        if cuda:
            end.record()
            end.synchronize()
        times.append(start.elapsed_time(end) if cuda else host_ms)
        if host is not None:
            host.append(host_ms)
    return times


def steady_ms(fn: Callable[[], object], device: torch.device, warmup: int, samples: int, calls: int,
              align: dist.ProcessGroup | bool = False) -> list[float]:
    """Steady-state ms per call of each of ``samples`` samples: ``calls`` runs of ``fn()`` back to back between two
    CUDA events (the host runs ahead; ``time.perf_counter`` on CPU) after ``warmup`` untimed runs, the device idle
    before each sample. ``align``: a process group (``True``: the default) meeting in a barrier before each sample."""
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


def interleaved_rounds(baselines: list[Callable[[], object]], cases: list[Callable[[], object]], rounds: int,
                       sample: Callable[[Callable[[], object]], float], on_round: Callable[[int], None] | None = None
                       ) -> tuple[list[list[float]], list[list[float]]]:
    """Samples in ``rounds`` interleaved rounds (drift hits every side alike): each round rank 0 samples every
    baseline alone (the others wait at a barrier), then every rank every case. ``sample``: ``fn -> ms``.
    Returns ``(baseline samples, case samples)``, one list per callable (baselines: empty off rank 0), this rank's."""
    rank0 = dist.get_rank() == 0
    base_s, case_s = [[] for _ in baselines], [[] for _ in cases]
    for r in range(rounds):
        if on_round is not None:
            on_round(r)
        dist.barrier()
        if rank0:
            for out, fn in zip(base_s, baselines):
                out.append(sample(fn))
        dist.barrier()
        for out, fn in zip(case_s, cases):
            out.append(sample(fn))
    return base_s, case_s


def max_over_ranks(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The maximum of ``value`` over the ranks of ``group`` (every rank gets it)."""
    return max_over_ranks_each([value], device, group)[0]


def max_over_ranks_each(values: list[float], device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks of ``group`` (same length on every rank)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


class Graphed:
    """``calls`` calls of ``fn()`` back to back, captured in one CUDA graph after ``warmup`` calls on a side stream;
    ``graphed()`` replays them and returns the last call's (static) output. ``group``: the ranks agree on the
    capture's outcome (every rank holds a graph or none). RuntimeError: the capture failed (with ``group``: on any
    rank, raised on every rank)."""

    def __init__(self, fn: Callable[[], object], device: torch.device, calls: int = 1, warmup: int = 2,
                 group: dist.ProcessGroup | None = None):
        warm_on_side_stream(fn, warmup, device)
        self.graph, self.out, reason = torch.cuda.CUDAGraph(), None, ""
        try:
            with torch.cuda.graph(self.graph):
                for _ in range(calls):
                    self.out = fn()
        except Exception as e:  # noqa: BLE001 - agreed over the group below, then raised on every rank
            if group is None:
                raise
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if group is not None:
            torch.cuda.synchronize(device)
            bad = failed_ranks(group, reason)
            if bad:
                self.graph = None
                raise RuntimeError(f"CUDA-graph capture failed on rank(s) {[i for i, _ in bad]}: {bad[0][1]}")

    def __call__(self):
        self.graph.replay()
        return self.out
