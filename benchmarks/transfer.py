"""K+V transfer time of the fast transport (copy engine and SM paths) vs NCCL, AGKV and Ulysses, side by side.

Workload: bf16, B=1, H=40, D=128; global sequence S split over the CP group (W ranks); per rank K and V
``[1, S/W, 40, 128]``. AGKV: all-gather of K+V (fast: direct peer writes into the final buffers; NCCL:
the torch transport's coalesced all-gather). Ulysses: the sequence->heads all-to-all of [K, V] (fast: the
transform folded into pitched peer writes; NCCL: the torch transport = pack + all_to_all_single, and the
all_to_all_single alone on a pre-packed buffer).

Method: CUDA events around launch + wait on the current stream; before each timed sample a host sync,
a barrier and a ~0.2 ms GPU sleep (so host launch cost is hidden the way it is in a model, for every
method alike); warm-up, then the median over iterations, then the max over ranks. Bandwidth is the bytes
one rank sends to one peer divided by the time (GB/s = 1e9 bytes/s). Every fast output is checked bitwise
against the torch transport once per size.

Usage (2 GPUs): ``python benchmarks/transfer.py --out DIR [--nproc 2] [--sizes 4096 8192 ...]``;
writes ``DIR/transfer.json``, ``DIR/transfer.md`` and ``DIR/transfer.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SIZES = [4096, 8192, 16384, 32768, 75600]
H, D = 40, 128
SLEEP_CYCLES = 1_000_000  # ~0.5 ms: the host enqueues the timed calls while the GPU sleeps
STEADY_REPS = 5


def _timeit(fn, iters: int, warmup: int, group, reps: int = 1) -> float:
    """ms per call: median over samples of (event time of ``reps`` back-to-back calls) / reps, max over ranks."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier(group=group)
        torch.cuda._sleep(SLEEP_CYCLES)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    t = torch.tensor([statistics.median(ts)], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _host_us(fn, n: int = 20) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def _body(rank, world, device, args):
    from cp_ops.transport import fast
    from cp_ops.transport import torch as tt
    from cp_ops.layout import ulysses_pack

    pg = dist.group.WORLD
    reason = fast.unavailable_reason("cuda")
    if reason:
        raise RuntimeError(f"fast transport unavailable: {reason}")
    rows = []
    for S in args.sizes:
        s = S // world
        g = torch.Generator(device="cuda").manual_seed(1234 + rank)
        k = torch.randn((1, s, H, D), generator=g, device="cuda").to(torch.bfloat16)
        v = torch.randn((1, s, H, D), generator=g, device="cuda").to(torch.bfloat16)
        row = {"S": S, "world": world, "agkv_bytes_per_peer": 2 * k.numel() * 2,
               "ulysses_bytes_per_peer": 2 * k.numel() * 2 // world}
        iters = args.iters if S < 32768 else max(10, args.iters // 2)

        def nccl_agkv():
            kf, vf, w = tt.transport.agkv_start(k, v, pg)
            w.wait()
            return kf, vf

        def nccl_uly():
            b, w = tt.transport.ulysses_start([k, v], pg)
            w.wait()
            return b

        send = ulysses_pack([k, v], world)
        recv = torch.empty_like(send)

        def nccl_a2a():
            pg.alltoall_base(recv, send, [], []).wait()

        ref_kf, ref_vf = nccl_agkv()
        ref_kf, ref_vf = ref_kf.clone(), ref_vf.clone()
        ref_u = nccl_uly().clone()
        row["nccl_agkv_ms"] = _timeit(nccl_agkv, iters, 3, pg)
        row["nccl_ulysses_ms"] = _timeit(nccl_uly, iters, 3, pg)
        row["nccl_a2a_only_ms"] = _timeit(nccl_a2a, iters, 3, pg)
        row["nccl_agkv_ss_ms"] = _timeit(nccl_agkv, iters, 1, pg, STEADY_REPS)
        row["nccl_ulysses_ss_ms"] = _timeit(nccl_uly, iters, 1, pg, STEADY_REPS)
        for path in args.paths:
            fast.configure(path=path)

            def fast_agkv():
                kf, vf, w = fast.transport.agkv_start(k, v, pg)
                w.wait()
                return kf, vf

            def fast_uly():
                b, w = fast.transport.ulysses_start([k, v], pg)
                w.wait()
                return b

            kf, vf = fast_agkv()  # first call: tunes this shape
            ok = torch.equal(kf, ref_kf) and torch.equal(vf, ref_vf)
            u = fast_uly()
            ok_u = torch.equal(u, ref_u)
            flags = torch.tensor([int(ok), int(ok_u)], device="cuda")
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=pg)
            row[f"{path}_agkv_bitwise_equal"] = bool(flags[0])
            row[f"{path}_ulysses_bitwise_equal"] = bool(flags[1])
            row[f"{path}_agkv_ms"] = _timeit(fast_agkv, iters, 3, pg)
            row[f"{path}_ulysses_ms"] = _timeit(fast_uly, iters, 3, pg)
            row[f"{path}_agkv_ss_ms"] = _timeit(fast_agkv, iters, 1, pg, STEADY_REPS)
            row[f"{path}_ulysses_ss_ms"] = _timeit(fast_uly, iters, 1, pg, STEADY_REPS)
            row[f"{path}_agkv_host_us"] = _host_us(fast_agkv)
        lane = fast.transport.lane
        row["decisions"] = {k_: d.label() for k_, d in ((("/".join(map(str, kk))), dd) for kk, dd in lane.decisions.items())
                            if f"/{s}/" in k_}
        for op, nb in (("agkv", "agkv_bytes_per_peer"), ("ulysses", "ulysses_bytes_per_peer"),
                       ("a2a_only", "ulysses_bytes_per_peer"), ("agkv_ss", "agkv_bytes_per_peer"),
                       ("ulysses_ss", "ulysses_bytes_per_peer")):
            for m in ["nccl"] + list(args.paths):
                key = f"{m}_{op}_ms"
                if key in row:
                    row[f"{m}_{op}_GBps"] = row[nb] / row[key] / 1e6
        best = min(row[f"{p}_agkv_ms"] for p in args.paths)
        row["agkv_ratio_best_fast_over_nccl"] = best / row["nccl_agkv_ms"]
        bu = min(row[f"{p}_ulysses_ms"] for p in args.paths)
        row["ulysses_ratio_best_fast_over_nccl"] = bu / row["nccl_ulysses_ms"]
        row["ulysses_ratio_best_fast_over_a2a_only"] = bu / row["nccl_a2a_only_ms"]
        row["agkv_ss_ratio_best_fast_over_nccl"] = min(row[f"{p}_agkv_ss_ms"] for p in args.paths) / row["nccl_agkv_ss_ms"]
        row["ulysses_ss_ratio_best_fast_over_nccl"] = (
            min(row[f"{p}_ulysses_ss_ms"] for p in args.paths) / row["nccl_ulysses_ss_ms"])
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
    describe = fast.describe()
    fast.shutdown()
    if rank == 0 and args.out:
        _write(rows, describe, world, Path(args.out))


def _write(rows, describe, world, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "gpus": world,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "heap": describe["lane"]["heap"] if describe.get("lane") else None,
        "fabric": describe["lane"]["fabric"] if describe.get("lane") else None,
        "workload": f"bf16, B=1, H={H}, D={D}, K+V of one CP{world} shard per rank",
        "method": "CUDA events around launch+wait on the current stream; host sync + barrier + ~0.5 ms GPU sleep "
                  "before each sample; warm-up 3; median over samples; max over ranks; 'single' = 1 call per sample, "
                  f"'steady' = {STEADY_REPS} back-to-back calls per sample",
        "targets": "fast <= 0.7x NCCL at S >= 8K, <= 0.8x at 4K",
    }
    (out / "transfer.json").write_text(json.dumps({"meta": meta, "rows": rows, "fast": describe}, indent=1, default=str))
    paths = [p for p in ("ce", "sm") if f"{p}_agkv_ms" in rows[0]]
    lines = [f"# Transfer: fast vs NCCL ({meta['gpu']} x{world}, torch {meta['torch']}, NCCL {meta['nccl']}, "
             f"{meta['date_utc']}, heap {meta['heap']}, fabric {meta['fabric']})", "",
             f"Workload: {meta['workload']}. Method: {meta['method']}. Targets: {meta['targets']}.", "",
             "## AGKV (all-gather of K+V)", "",
             "| S | MB/peer | NCCL ms (GB/s) | " + " | ".join(f"fast {p.upper()} ms (GB/s)" for p in paths)
             + " | best fast / NCCL | bitwise | chosen |",
             "|---|---|---|" + "---|" * len(paths) + "---|---|---|"]
    for r in rows:
        ch = "; ".join(f"{k.split('/')[0]}:{v}" for k, v in r["decisions"].items() if "agkv" in k)
        lines.append(
            f"| {r['S']} | {r['agkv_bytes_per_peer'] / 1e6:.1f} | {r['nccl_agkv_ms']:.3f} ({r['nccl_agkv_GBps']:.0f}) | "
            + " | ".join(f"{r[f'{p}_agkv_ms']:.3f} ({r[f'{p}_agkv_GBps']:.0f})" for p in paths)
            + f" | {r['agkv_ratio_best_fast_over_nccl']:.2f}x | "
            + ("yes" if all(r[f"{p}_agkv_bitwise_equal"] for p in paths) else "NO") + f" | {ch} |")
    lines += ["", "## Ulysses all-to-all of [K, V] (sequence -> heads)", "",
              "| S | MB/peer | NCCL (pack+a2a) ms (GB/s) | NCCL a2a only ms | "
              + " | ".join(f"fast {p.upper()} ms (GB/s)" for p in paths) + " | best fast / NCCL | bitwise |",
              "|---|---|---|---|" + "---|" * len(paths) + "---|---|"]
    for r in rows:
        lines.append(
            f"| {r['S']} | {r['ulysses_bytes_per_peer'] / 1e6:.1f} | {r['nccl_ulysses_ms']:.3f} ({r['nccl_ulysses_GBps']:.0f}) | "
            f"{r['nccl_a2a_only_ms']:.3f} | "
            + " | ".join(f"{r[f'{p}_ulysses_ms']:.3f} ({r[f'{p}_ulysses_GBps']:.0f})" for p in paths)
            + f" | {r['ulysses_ratio_best_fast_over_nccl']:.2f}x | "
            + ("yes" if all(r[f"{p}_ulysses_bitwise_equal"] for p in paths) else "NO") + " |")
    lines += ["", f"## Steady state: {STEADY_REPS} back-to-back calls per timed sample (each waited on the stream)", "",
              "| S | AGKV NCCL ms (GB/s) | " + " | ".join(f"AGKV fast {p.upper()} ms (GB/s)" for p in paths)
              + " | AGKV best/NCCL | Ulysses NCCL ms | " + " | ".join(f"Ulysses fast {p.upper()} ms" for p in paths)
              + " | Ulysses best/NCCL |",
              "|---|---|" + "---|" * len(paths) + "---|---|" + "---|" * len(paths) + "---|"]
    for r in rows:
        lines.append(
            f"| {r['S']} | {r['nccl_agkv_ss_ms']:.3f} ({r['nccl_agkv_ss_GBps']:.0f}) | "
            + " | ".join(f"{r[f'{p}_agkv_ss_ms']:.3f} ({r[f'{p}_agkv_ss_GBps']:.0f})" for p in paths)
            + f" | {r['agkv_ss_ratio_best_fast_over_nccl']:.2f}x | {r['nccl_ulysses_ss_ms']:.3f} | "
            + " | ".join(f"{r[f'{p}_ulysses_ss_ms']:.3f}" for p in paths)
            + f" | {r['ulysses_ss_ratio_best_fast_over_nccl']:.2f}x |")
    lines += ["", "Host launch cost of one fast AGKV call (µs): "
              + ", ".join(f"S={r['S']}: " + "/".join(f"{r[f'{p}_agkv_host_us']:.0f}" for p in paths) for r in rows)]
    (out / "transfer.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axs = plt.subplots(1, 2, figsize=(11, 4))
        xs = [r["S"] for r in rows]
        for ax, op in zip(axs, ("agkv", "ulysses")):
            ax.plot(xs, [r[f"nccl_{op}_GBps"] for r in rows], "o-", label="NCCL")
            for p in paths:
                ax.plot(xs, [r[f"{p}_{op}_GBps"] for r in rows], "s-", label=f"fast {p.upper()}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("global sequence S")
            ax.set_ylabel("GB/s per rank to one peer")
            ax.set_title(f"{op.upper()} K+V, bf16 H={H} D={D}, CP{world}")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "transfer.png", dpi=120)
    except Exception as e:  # noqa: BLE001
        print(f"plot skipped: {e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for transfer.json/.md/.png (rank 0 writes)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--paths", nargs="+", default=["ce", "sm"], choices=["ce", "sm", "auto"])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    os.environ.setdefault("CP_OPS_FAST_POOL_GB", "16")
    from cp_ops.cli.launch import launch

    launch(_body, args.nproc, "cuda", args)


if __name__ == "__main__":
    main()
