"""Where the GPU time of ``cp_ops.attention`` goes: a profiler timeline of N calls back to back, per configuration.

For each (S, mode, transport, chunks): warm-up, then ``--n`` calls issued back to back (as consecutive layers run)
under ``torch.profiler`` with CUDA activity; the trace's GPU events are classified and summed per call:

* ``attn``: attention kernels (cuDNN / flash / fmha), ``merge``: the LSE merge, ``comm``: NCCL kernels, copy-engine
  copies (``gpu_memcpy``: the fast transport's P2P writes) and the fast transport's SM copy kernel, ``wait``: the
  fast transport's flag kernels (spins on a flag: not work), ``other``: everything else (packing copies, casts).
* ``span``: first GPU event start to last end, per call — the time a model would see.
* ``busy``: the union of all non-wait intervals; ``idle = span - busy`` (the GPU doing nothing: host-bound or
  waiting on a peer); ``overlap``: time where a comm interval and a compute interval (attn, merge, other) run
  at once — communication hidden under compute.
* ``host``: wall time to issue the N calls / N (no synchronisation inside the loop): where ``host`` ≥ ``span``
  the host, not the GPU, sets the pace.

Every number is µs per call, max over ranks. The profiler adds a little host time per launch; the ``span``
column of an uninstrumented run is ``cp-ops bench``'s steady-state time.

Usage (2 GPUs): ``python benchmarks/timeline.py --out DIR [--nproc 2] [--sizes 4096] [--chunks 1 2]``;
writes ``DIR/timeline.json`` and ``DIR/timeline.md``; ``--traces`` also keeps rank 0's Chrome traces.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cp_ops import timing  # noqa: E402
from cp_ops.cli.profile import KERNEL_CLASSES, attention_timeline  # noqa: E402

B, H, D = 1, 40, 128


def _measure(fn, n: int, group, trace_path: Path | None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) * 1e6 / n
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
        if trace_path is not None:
            trace_path.write_text(path.read_text())
    row = attention_timeline(events, n)
    row["host"] = host
    for k in ("span", "busy", "idle", "overlap", "host", *KERNEL_CLASSES):
        row[k] = timing.max_over_ranks(row.get(k, 0.0), torch.device("cuda"), group)
    return row


def _worker(rank: int, world: int, dev: torch.device, args) -> None:
    import cp_ops

    group = dist.group.WORLD
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for s in args.sizes:
        sl = s // world
        g = torch.Generator(device=dev).manual_seed(s)
        q, k, v = (torch.randn(B, sl, H, D, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
                   for _ in range(3))
        qf, kf, vf = (torch.randn(B, s, H, D, generator=g, device=dev).to(torch.bfloat16) for _ in range(3))
        configs = [("1 GPU", "-", None, lambda a=qf, b=kf, c=vf: cp_ops.local_attention(a, b, c))]
        for transport in args.transports:
            for mode in args.modes:
                for chunks in args.chunks:
                    configs.append((mode, transport, chunks,
                                    lambda m=mode, t=transport, c=chunks, x=(q, k, v):
                                    cp_ops.attention(*x, mode=m, transport=t, chunks=c)))
        for mode, transport, chunks, fn in configs:
            tag = f"S{s}_{mode.replace(' ', '')}_{transport}_c{chunks}"
            trace = out / f"trace_{tag}_rank{rank}.json" if args.traces and rank == 0 else None
            row = {"S": s, "W": world, "mode": mode, "transport": transport, "chunks": chunks,
                   **_measure(fn, args.n, group, trace)}
            rows.append(row)
            if rank == 0:
                print(f"S={s} {mode:7s} {transport:5s} c={chunks!s:4s} span {row['span']:7.1f} busy {row['busy']:7.1f} "
                      f"idle {row['idle']:6.1f} attn {row['attn']:7.1f} merge {row['merge']:5.1f} comm "
                      f"{row['comm']:6.1f} overlap {row['overlap']:6.1f} wait {row['wait']:6.1f} other "
                      f"{row['other']:6.1f} host {row['host']:6.1f} µs/call", flush=True)
                for name, count, us in row["top"]:
                    print(f"      {us:8.1f} µs/call  x{count:<4d} {name}", flush=True)
        del q, k, v, qf, kf, vf, configs, fn
        torch.cuda.empty_cache()
    if rank == 0:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "W": world, "B": B, "H": H, "D": D,
                "dtype": "bfloat16", "calls": args.n, "unit": "µs per call, max over ranks"}
        (out / "timeline.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        cols = ("span", "busy", "idle", "attn", "merge", "comm", "overlap", "wait", "other", "host")
        lines = [f"# cp_ops.attention GPU timeline, W={world}, {meta['gpu']}, torch {meta['torch']}", "",
                 f"bf16 B={B} H={H} D={D}, {args.n} calls back to back under torch.profiler; µs per call, max over "
                 "ranks (see benchmarks/timeline.py for the columns).", "",
                 "| S | mode | transport | chunks | " + " | ".join(cols) + " |", "|---" * (4 + len(cols)) + "|"]
        for r in rows:
            lines.append(f"| {r['S']} | {r['mode']} | {r['transport']} | {r['chunks']} | "
                         + " | ".join(f"{r.get(c, 0.0):.1f}" for c in cols) + " |")
        (out / "timeline.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=f"Shapes: bf16, B={B}, H={H}, D={D}; lists are space-separated (--sizes 4096 "
                                       "8192). Columns: see the module docstring (from the repository root: python -c "
                                       "'import benchmarks.timeline as t; help(t)').")
    p.add_argument("--out", required=True, help="folder for timeline.json / timeline.md (and traces)")
    p.add_argument("--nproc", type=int, default=2, help="CP world size W, one GPU per rank (default 2)")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096], help="global sequence lengths S (default 4096)")
    p.add_argument("--modes", nargs="+", default=["agkv", "ulysses"], help="agkv, ulysses (default both)")
    p.add_argument("--transports", nargs="+", default=["torch", "fast"], help="torch, fast (default both)")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2],
                   help="chunk counts: 1 = transport, then attend; k >= 2 = pipelined (default 1 2)")
    p.add_argument("--n", type=int, default=20, help="calls back to back under the profiler (default 20)")
    p.add_argument("--traces", action="store_true", help="keep rank 0's Chrome trace per configuration")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/timeline.py needs CUDA GPUs")
    from cp_ops.cli.launch import launch

    launch(_worker, args.nproc, "cuda", args)


if __name__ == "__main__":
    main()
