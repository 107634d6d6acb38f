"""Host time per ``cp_ops.attention`` call, per transport, mode, chunks and rank-check setting.

At a tiny shape (default B=1, S_local=128, H=8, D=64, bf16 on CUDA) the GPU work is a few µs, so the wall time
of N calls issued back to back (no synchronisation inside the loop) divided by N is the host's own cost per
call: Python, the plan lookup, the rank-contract exchange, transport bookkeeping, kernel launches.

    python benchmarks/host_cost.py [--nproc 2] [--calls 300] [--out DIR]          # GPUs: NCCL ranks
    python benchmarks/host_cost.py --fake [--nproc 2]                              # CPU: a fake CP group

``--fake`` (CPU): each rank is a real process (gloo default group), the CP group is a ``fake``-backend group
whose collectives do nothing, so the rows are cp_ops' own host cost plus the attention kernel at the (CPU
default: tiny) shape; the rank contract still exchanges across the processes (shared memory,
its state's ``skip`` cleared). Without ``--fake`` on CPU the gloo collectives (synchronous, ~ms) dominate.

Rows: transport (torch; fast on CUDA) × mode (agkv, ulysses) × chunks (1, 2) × check_ranks (once, off), the
median and the minimum wall time over 5 timed loops and the median CPU time of the rank's process (the host
work itself, without waiting for a core on a busy machine), max over ranks, in µs per call. Two reference rows: ``sdpa`` (one
``cp_ops.local_attention`` over W·S_local keys: the attention kernel's own host cost) and ``rank check`` (one
exchange of the rank contract). Writes ``host_cost.json`` under ``--out`` when given.

Graph rows (CUDA only; skipped with a printed reason on CPU and under ``--fake``): ``agkv graph`` and ``ulysses
graph`` per transport, chunks 1: ``--graph-calls`` N calls of ``cp_ops.attention`` back to back captured in one
``torch.cuda.CUDAGraph`` (each shape warmed up eagerly on a side stream first, as torch's docs say: a fast call's
first call of a shape inside a capture raises by design), then replays issued back to back (``--calls`` / N of
them, no synchronisation inside): host µs per attention call = the replays' wall time / (replays · N), and
``GPU µs`` = the same replays' CUDA-event time / (replays · N) (the GPU's own time per call, for context: where it
exceeds the host time, the host keeps ahead). The rank check runs at capture only (0 exchanges per replay); the
fast transport keeps each captured call's flag slot and pool buffers until shutdown (256 slots per lane), so N is
kept small (default 20).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _time_loop(fn, calls: int, sync, barrier) -> tuple[float, float, float]:
    """(median, min) wall µs per call over 5 loops, and the median CPU time of this process per call (µs): on a
    busy machine the wall time includes waiting for a core, the CPU time does not)."""
    per_call, cpu = [], []
    for _ in range(5):
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
        cpu.append((time.process_time() - c0) / calls * 1e6)
        sync()
    return statistics.median(per_call), min(per_call), statistics.median(cpu)


def _profile(fn, args, rank, label, sync, barrier) -> None:
    """cProfile of ``args.calls`` calls; rank 0 prints the ``args.profile`` functions of most own time."""
    import cProfile
    import io
    import pstats

    barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    sync()
    if rank == 0:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile)
        body = out.getvalue()
        start = body.find("   ncalls")
        print(f"--- profile (rank 0, {args.calls} calls, cProfile inflates Python-heavy rows): {label}")
        print(body[start:].rstrip() if start >= 0 else body.rstrip())


def _graph_rows(q, k, v, group, transports, args, rank, sync, barrier) -> list[dict]:
    """Host (and GPU) µs per call of ``cp_ops.attention`` replayed from a CUDA graph of ``args.graph_calls`` calls,
    per transport and mode, chunks 1 (see the module docstring); [] with a printed reason off CUDA. Values are
    max-reduced over the ranks here (the caller's reduce of median/min/CPU is then a no-op for these rows)."""
    import torch
    import torch.distributed as dist

    import cp_ops
    from cp_ops import config, timing

    if q.device.type != "cuda" or args.fake:
        if rank == 0:
            print("graph rows skipped: CUDA graphs need CUDA tensors and a real CP group "
                  f"({'--fake' if args.fake else 'device ' + q.device.type})")
        return []
    n = max(1, args.graph_calls)
    replays = max(1, args.calls // n)
    config.configure(check_ranks="on")  # the check runs at capture; a replay exchanges nothing
    rows = []
    for tr in transports:
        for mode in ("agkv", "ulysses"):
            def call(tr=tr, mode=mode):
                return cp_ops.attention(q, k, v, group=group, mode=mode, transport=tr, chunks=1)

            sync()
            barrier()
            try:  # warm-up on a side stream, then the capture; every rank skips the row, or none
                g = timing.Graphed(call, q.device, calls=n, warmup=3, group=dist.group.WORLD)
            except RuntimeError as e:
                if rank == 0:
                    print(f"graph row {tr} {mode} skipped: {e}")
                continue
            g()  # the first replay uploads the graph
            sync()
            host, cpu, gpu = [], [], []
            for _ in range(5):
                barrier()
                sync()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(replays):
                    g()  # no synchronisation inside: the host's own cost per replay
                host.append((time.perf_counter() - t0) / (replays * n) * 1e6)
                cpu.append((time.process_time() - c0) / (replays * n) * 1e6)
                end.record()
                end.synchronize()
                gpu.append(start.elapsed_time(end) / (replays * n) * 1e3)
            vals = torch.tensor([statistics.median(host), min(host), statistics.median(cpu), statistics.median(gpu)],
                                dtype=torch.float64, device=q.device)
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            med, lo, c, gu = vals.tolist()
            rows.append({"transport": tr, "mode": f"{mode} graph", "chunks": 1, "check_ranks": "once",
                         "median_us": med, "min_us": lo, "cpu_us": c, "gpu_us": gu, "graph_calls": n,
                         "replays": replays})
            del g
            sync()
            barrier()
    return rows


#: uneven shards / key-padding masks (cp_ops.layout.Shards), torch transport, chunks=1: (label, seq_lens?, mask?)
LAYOUT_CASES = (("seq", True, False), ("mask", False, True), ("seq+mask", True, True))


def _layout_rows(q, k, v, group, rank, world, args, sync, barrier) -> list:
    """Rows for ``cp_ops.attention(..., seq_lens=, key_mask=)`` calls (``--layouts``): each mode x LAYOUT_CASES,
    check_ranks once. ``seq``: rank r holds S_local - r tokens (the last rows of q/k/v dropped); ``mask``: a random
    bool key mask (about 1/3 padding keys)."""
    import torch

    import cp_ops
    from cp_ops import config

    s = q.shape[1]
    seq = tuple(s - r for r in range(world))
    mine = (q[:, : seq[rank]], k[:, : seq[rank]], v[:, : seq[rank]])
    g = torch.Generator(device=q.device).manual_seed(rank + 100)
    rows = []
    config.configure(check_ranks="on")
    for mode in ("agkv", "ulysses"):
        for label, uneven, masked in LAYOUT_CASES:
            qq, kk, vv = mine if uneven else (q, k, v)
            mask = (torch.rand(q.shape[0], qq.shape[1], generator=g, device=q.device) > 0.35) if masked else None

            def call():
                cp_ops.attention(qq, kk, vv, group=group, mode=mode, transport="torch", chunks=1,
                                 seq_lens=seq if uneven else None, key_mask=mask)

            for _ in range(20):
                call()
            sync()
            med, lo, cpu = _time_loop(call, args.calls, sync, barrier)
            rows.append({"transport": "torch", "mode": f"{mode}/{label}", "chunks": 1, "check_ranks": "once",
                         "median_us": med, "min_us": lo, "cpu_us": cpu})
            if args.profile:
                _profile(call, args, rank, f"torch {mode} {label}", sync, barrier)
            if args.ops:  # every rank calls (the rank contract), rank 0 prints
                n = _count_ops(call)
                if rank == 0:
                    print(f"aten ops per call (rank 0), torch {mode}/{label}: {n}")
    return rows


def _count_ops(fn) -> str:
    """Ops one call of ``fn`` runs, from the torch profiler's CPU events (a TorchDispatchMode would send
    cp_ops.attention to its general path): top-level ``aten::`` calls (what Python dispatches), all ``aten::`` calls
    (with the ops they call inside, e.g. ``aten::pad`` → ``aten::constant_pad_nd`` → ``aten::empty`` ...), both
    without the ops a collective runs inside (``c10d::*``: the fake group's own copies), and the custom ops
    dispatched (``cp_ops::*``, ``_c10d_functional::*``: each through the dispatcher's Python layers)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def in_collective(e):
        while e is not None:
            if e.name.startswith("c10d::"):
                return True
            e = e.cpu_parent
        return False

    events = [e for e in prof.events() if e.name.startswith("aten::") and not in_collective(e)]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    custom = [e for e in prof.events() if e.name.startswith(("cp_ops::", "_c10d_functional::"))]
    return f"aten {len(top)} top-level, {len(events)} in all; custom ops {len(custom)}"


def _body(rank, world, device, args):
    import torch
    import torch.distributed as dist

    import cp_ops
    from cp_ops import config

    try:
        from cp_ops import contract as validate  # the rank contract (cp_ops.validate before the split)
    except ImportError:
        from cp_ops import validate

    group = None
    if device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the cores: no intra-op threads competing with the other rank
    if args.fake:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the 'fake' backend)
        from torch._C._distributed_c10d import FakeWork

        # a fake collective is done at launch, but FakeWork.is_completed() says False forever: a wait that polls it
        # (cp_ops.contract.BoundedWork, a CPU group's bounded wait) would run to its timeout
        FakeWork.is_completed = lambda self: True
        group = dist.new_group(list(range(world)), backend="fake")
        validate._state(group).skip = False  # each rank is a real process: the rank contract exchanges as usual
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = tuple(args.shape) if args.shape else ((1, 128, 8, 64) if device.type == "cuda" else (1, 16, 8, 16))
    g = torch.Generator(device=device).manual_seed(rank)
    q, k, v = (torch.randn(*shape, generator=g, device=device, dtype=dtype) for _ in range(3))
    transports = ["torch"]
    if device.type == "cuda":
        from cp_ops.transport import fast

        reason = fast.unavailable_reason("cuda")
        if reason is None:
            transports.append("fast")
        elif rank == 0:
            print(f"fast transport skipped: {reason}")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def barrier():
        dist.barrier()

    rows = []
    saved = config.snapshot()
    with torch.no_grad():
        kk = torch.randn(shape[0], world * shape[1], *shape[2:], generator=g, device=device, dtype=dtype)
        med, lo, cpu = _time_loop(lambda: cp_ops.local_attention(q, kk, kk), args.calls, sync, barrier)
        rows.append({"transport": "-", "mode": "sdpa", "chunks": "-", "check_ranks": "-", "median_us": med, "min_us": lo,
                     "cpu_us": cpu})
        pg = group or dist.group.WORLD
        if hasattr(validate, "CallCheck"):
            check_once = validate.CallCheck(pg, "host_cost rank check", "torch", shape, dtype, 3).check
        else:  # before the eager plans (for before/after numbers)
            def check_once():
                validate.exchange(pg, "host_cost rank check", "torch", q, 3)
        med, lo, cpu = _time_loop(check_once, args.calls, sync, barrier)
        rows.append({"transport": "-", "mode": "rank check", "chunks": "-", "check_ranks": "once", "median_us": med,
                     "min_us": lo, "cpu_us": cpu})
        for tr in transports:
            for mode in ("agkv", "ulysses"):
                for chunks in (1, 2):
                    for check in ("once", "off"):
                        config.configure(check_ranks=check)

                        def call():
                            cp_ops.attention(q, k, v, group=group, mode=mode, transport=tr, chunks=chunks)

                        for _ in range(20):  # warm-up: first-call checks, the plan, tuning, the pool
                            call()
                        sync()
                        med, lo, cpu = _time_loop(call, args.calls, sync, barrier)
                        rows.append({"transport": tr, "mode": mode, "chunks": chunks, "check_ranks": check,
                                     "median_us": med, "min_us": lo, "cpu_us": cpu})
                        if args.profile and check == "once":
                            _profile(call, args, rank, f"{tr} {mode} chunks={chunks} check={check}", sync, barrier)
        rows += _graph_rows(q, k, v, group, transports, args, rank, sync, barrier)
        if args.layouts:
            rows += _layout_rows(q, k, v, group, rank, world, args, sync, barrier)
    config.restore(saved)
    vals = torch.tensor([[r["median_us"], r["min_us"], r["cpu_us"]] for r in rows], dtype=torch.float64,
                        device=device if not args.fake else "cpu")
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)  # the default group (gloo under --fake)
    for r, (med, lo, cpu) in zip(rows, vals.tolist()):
        r["median_us"], r["min_us"], r["cpu_us"] = med, lo, cpu
    if rank == 0:
        kind = "fake CP group (no data moved)" if args.fake else device.type
        print(f"host time per cp_ops.attention call, W={world}, {kind}, shape {list(shape)} {str(dtype)[6:]}, "
              f"{args.calls} calls back to back; median and min of 5 loops, max over ranks; torch {torch.__version__}")
        print(f"{'transport':>9} {'mode':>13} {'chunks':>6} {'check':>6} {'median µs':>10} {'min µs':>8} "
              f"{'CPU µs':>8} {'GPU µs':>8}")
        for r in rows:
            gpu = f"{r['gpu_us']:8.1f}" if "gpu_us" in r else f"{'-':>8}"  # graph rows only
            print(f"{r['transport']:>9} {r['mode']:>13} {r['chunks']!s:>6} {r['check_ranks']:>6} "
                  f"{r['median_us']:10.1f} {r['min_us']:8.1f} {r['cpu_us']:8.1f} {gpu}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "host_cost.json"), "w") as f:
                json.dump({"world_size": world, "device": device.type, "fake_group": args.fake, "shape": list(shape),
                           "dtype": str(dtype), "calls": args.calls, "torch": torch.__version__, "rows": rows}, f,
                          indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks (GPUs on CUDA; processes on CPU)")
    ap.add_argument("--calls", type=int, default=300, help="calls per timed loop")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--fake", action="store_true", help="CPU: a fake-backend CP group (no data moved; see above)")
    ap.add_argument("--shape", type=int, nargs=4, metavar=("B", "S_LOCAL", "H", "D"), default=None,
                    help="default 1 128 8 64 on CUDA, 1 16 8 16 on CPU")
    ap.add_argument("--out", default=None, help="folder for host_cost.json")
    ap.add_argument("--graph-calls", type=int, default=20, metavar="N",
                    help="CUDA only: attention calls captured in one CUDA graph for the 'graph' rows (see above)")
    ap.add_argument("--layouts", action="store_true",
                    help="also time seq_lens / key_mask calls (cp_ops.layout.Shards; LAYOUT_CASES)")
    ap.add_argument("--ops", action="store_true", help="with --layouts: print the aten ops per call (rank 0)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also print rank 0's cProfile top N functions (own time) per row with check_ranks=once")
    args = ap.parse_args()
    import torch

    from cp_ops.cli.launch import launch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() and not args.fake
                                                        else "cpu")
    if args.fake and device != "cpu":
        ap.error("--fake runs on CPU")
    launch(_body, args.nproc, device, args)


if __name__ == "__main__":
    main()
