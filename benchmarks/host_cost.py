"""Host time per ``cp_ops.attention`` call, per transport, mode and rank-check setting.

At a tiny shape (B=1, S_local=128, H=8, D=64, bf16 on CUDA; fp32 on CPU) the GPU work is a few µs, so the
wall time of N calls issued back to back (no synchronisation inside the loop) divided by N is the host's
own cost per call: Python, validation, the rank-contract exchange, transport bookkeeping, launches.

    python benchmarks/host_cost.py [--nproc 2] [--calls 300] [--out DIR]

Prints one row per (transport, mode, check) with the median over 5 repeats, max over ranks, in µs; writes
``host_cost.json`` under ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _body(rank, world, device, args):
    import torch
    import torch.distributed as dist

    import cp_ops
    from cp_ops import config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(rank)
    q, k, v = (torch.randn(1, 128, 8, 64, generator=g, device=device, dtype=dtype) for _ in range(3))
    transports = ["torch"] + (["fast"] if device.type == "cuda" else [])
    rows = []
    with torch.no_grad():
        for tr in transports:
            for mode in ("agkv", "ulysses"):
                for check in ("once", "off"):
                    config.configure(check_ranks=check)
                    for _ in range(20):  # warm-up: first-call checks, tuning, pool
                        cp_ops.attention(q, k, v, mode=mode, transport=tr, chunks=1)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    per_call = []
                    for _ in range(5):
                        dist.barrier()
                        t0 = time.perf_counter()
                        for _ in range(args.calls):
                            cp_ops.attention(q, k, v, mode=mode, transport=tr, chunks=1)
                        per_call.append((time.perf_counter() - t0) / args.calls * 1e6)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                    med = torch.tensor([statistics.median(per_call)], dtype=torch.float64, device=device)
                    dist.all_reduce(med, op=dist.ReduceOp.MAX)
                    rows.append({"transport": tr, "mode": mode, "check_ranks": check, "host_us_per_call": med.item()})
    config.configure(check_ranks="once")
    if rank == 0:
        print(f"host time per cp_ops.attention call, W={world}, {device.type}, {args.calls} calls back to back, "
              "median of 5, max over ranks")
        print(f"{'transport':>9} {'mode':>8} {'check':>6} {'µs/call':>9}")
        for r in rows:
            print(f"{r['transport']:>9} {r['mode']:>8} {r['check_ranks']:>6} {r['host_us_per_call']:9.1f}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "host_cost.json"), "w") as f:
                json.dump({"world_size": world, "device": device.type, "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks (GPUs on CUDA; gloo processes on CPU)")
    ap.add_argument("--calls", type=int, default=300, help="calls per timed loop")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--out", default=None, help="folder for host_cost.json")
    args = ap.parse_args()
    import torch

    from cp_ops.cli.launch import launch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    launch(_body, args.nproc, device, args)


if __name__ == "__main__":
    main()
