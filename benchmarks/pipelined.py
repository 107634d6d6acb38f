"""Pipelined CP attention (issue 9) vs one GPU: steady-state time per (mode, chunks, transport).

Workload: bf16, B=1, H=40, D=128, dense non-causal; global sequence S in {4096, 8192, 16384, 32768, 75600}
split over W ranks (``--nproc``). Per configuration: ``cp_ops.attention(q, k, v, mode=, transport=, chunks=)``
on each rank's ``[1, S/W, 40, 128]`` shard; the baseline is single-GPU cuDNN SDPA on the whole ``[1, S, 40, 128]``
(``cp_ops.local_attention``), timed the same way in the same run (on every rank at once; max over ranks).

Steady state (how consecutive layers run while the host runs ahead): warm-up, then N = 20 calls back to back
between two CUDA events; the median over 5 such samples of (event time / N); the max over ranks. Speedup =
baseline ÷ CP time. Each configuration's first output is checked against the single-GPU output (max relative
error, bf16). ``--max-minutes`` (default 3.4) bounds the run: a configuration whose projected time would pass it
is skipped (every rank agrees) and listed as skipped.

Usage (2 GPUs): ``python benchmarks/pipelined.py --out DIR [--nproc 2] [--sizes ...] [--chunks 1 2 4]``;
writes ``DIR/pipelined.json``, ``DIR/pipelined.md`` and (with matplotlib) ``DIR/pipelined.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cp_ops import timing  # noqa: E402

SIZES = [4096, 8192, 16384, 32768, 75600]
B, H, D = 1, 40, 128
WARMUP = 3


def _steady_ms(fn, n: int, reps: int, group) -> float:
    """Median over ``reps`` samples of (CUDA-event time of ``n`` back-to-back calls) / n, max over ranks."""
    return _max(statistics.median(timing.steady_ms(fn, torch.device("cuda"), WARMUP, reps, n, align=group)), group)


def _max(x: float, group) -> float:
    t = torch.tensor([x], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _once_ms(fn, group) -> float:
    """One call's GPU time (also the first call: plans, tuning), max over ranks: for the time projection."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = fn()
    b.record()
    b.synchronize()
    return _max(a.elapsed_time(b), group), out


def _worker(rank: int, world: int, dev: torch.device, args) -> None:
    import cp_ops
    from cp_ops.transport import base as transport_base

    group = dist.group.WORLD
    t_start = time.perf_counter()
    budget_s = args.max_minutes * 60.0
    rows, baseline = [], {}
    transports = []
    for t in args.transports:
        reason = transport_base.get(t).unavailable_reason(dev)
        if reason is None:
            transports.append(t)
        elif rank == 0:
            print(f"transport {t} unavailable: {reason}", flush=True)
            rows.append({"transport": t, "skipped": f"unavailable: {reason}"})

    def over_budget(projected_s: float) -> bool:
        late = time.perf_counter() - t_start + projected_s > budget_s
        return _max(float(late), group) > 0

    for s in args.sizes:
        if s % world:
            continue
        sl = s // world
        g = torch.Generator(device=dev).manual_seed(s)
        q, k, v = (torch.randn(B, s, H, D, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
                   for _ in range(3))
        _, ref = _once_ms(lambda: cp_ops.local_attention(q, k, v), group)
        first_ms, _ = _once_ms(lambda: cp_ops.local_attention(q, k, v), group)  # past plan creation
        n_calls = WARMUP + args.n * args.reps
        if over_budget(first_ms * n_calls / 1e3):
            rows.append({"S": s, "skipped": "--max-minutes"})
            break
        baseline[s] = _steady_ms(lambda: cp_ops.local_attention(q, k, v), args.n, args.reps, group)
        ql, kl, vl = (t[:, rank * sl:(rank + 1) * sl].contiguous() for t in (q, k, v))
        ref_l = ref[:, rank * sl:(rank + 1) * sl].float()
        del q, k, v, ref
        for transport in transports:
            for mode in args.modes:
                for chunks in args.chunks:
                    row = {"S": s, "W": world, "mode": mode, "transport": transport, "chunks": chunks}

                    def call(mode=mode, transport=transport, chunks=chunks):
                        return cp_ops.attention(ql, kl, vl, mode=mode, transport=transport, chunks=chunks)

                    _, out = _once_ms(call, group)  # first call: plans, transport tuning, the measured choice
                    if mode == "auto" or chunks is None:
                        picked = cp_ops.describe(ql, group=group, mode=mode, transport=transport, chunks=chunks)
                        row["picked"] = f"{picked.mode} c={picked.chunks} ({picked.source})"
                    first_ms, _ = _once_ms(call, group)
                    err = ((out.float() - ref_l).abs().max() / ref_l.abs().max()).item()
                    row["max_rel_err"] = _max(err, group)
                    if over_budget(first_ms * n_calls / 1e3):
                        row["skipped"] = "--max-minutes"
                    else:
                        row["ms"] = _steady_ms(call, args.n, args.reps, group)
                        row["baseline_ms"] = baseline[s]
                        row["speedup"] = baseline[s] / row["ms"]
                    rows.append(row)
                    if rank == 0:
                        shown = (f"{row['ms']:.3f} ms  {row['speedup']:.2f}x" if "ms" in row else row["skipped"])
                        print(f"S={s:6d} W={world} {mode:8s} {transport:5s} chunks={chunks!s:4s} {shown}  "
                              + (f"[picked {row['picked']}] " if row.get("picked") else "") +
                              f"(1 GPU {baseline[s]:.3f} ms; max rel err {row['max_rel_err']:.1e})", flush=True)
        del ql, kl, vl, ref_l
        torch.cuda.empty_cache()
    if rank == 0:
        _write(args, world, baseline, rows, time.perf_counter() - t_start)


def _write(args, world: int, baseline: dict, rows: list, elapsed_s: float) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "W": world, "B": B, "H": H, "D": D,
            "dtype": "bfloat16", "n_calls": args.n, "samples": args.reps, "elapsed_s": round(elapsed_s, 1),
            "method": "steady state: N calls back to back between two CUDA events, median of samples, max over ranks"}
    (out / "pipelined.json").write_text(json.dumps({"meta": meta, "baseline_ms": baseline, "rows": rows}, indent=1))
    configs = sorted({(r["mode"], r["transport"], str(r["chunks"])) for r in rows if "mode" in r})
    lines = [f"# Pipelined CP attention, W={world}, {meta['gpu']}, torch {meta['torch']}, {meta['date']}", "",
             f"bf16 B={B} H={H} D={D}; {meta['method']} (N={args.n}, {args.reps} samples). "
             "Cells: CP ms (speedup over the same-run 1-GPU cuDNN).", "",
             "| S | 1 GPU ms | " + " | ".join(f"{m} {t} c={c}" for m, t, c in configs) + " | best |",
             "|---" * (len(configs) + 3) + "|"]
    for s, base in baseline.items():
        cells, best = [], None
        for m, t, c in configs:
            r = next((r for r in rows if r.get("S") == s and (r["mode"], r["transport"], str(r["chunks"])) == (m, t, c)),
                     None)
            if r is None or "ms" not in r:
                cells.append("—")
                continue
            cells.append(f"{r['ms']:.3f} ({r['speedup']:.2f}x)" + (f" [{r['picked']}]" if r.get("picked") else ""))
            if best is None or r["speedup"] > best["speedup"]:
                best = r
        tag = f"{best['speedup']:.2f}x {best['mode']} {best['transport']} c={best['chunks']}" if best else "—"
        lines.append(f"| {s} | {base:.3f} | " + " | ".join(cells) + f" | {tag} |")
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{r.get('S', '')} {r.get('mode', '')} {r.get('transport', '')} "
                                               f"c={r.get('chunks', '')}: {r['skipped']}" for r in skipped)]
    (out / "pipelined.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", flush=True)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for m, t, c in configs:
        pts = [(r["S"], r["speedup"]) for r in rows
               if (r.get("mode"), r.get("transport"), str(r.get("chunks"))) == (m, t, c) and "ms" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{m} {t} chunks={c}")
    ax.axhline(world, color="grey", linestyle=":", label=f"ideal {world}x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global sequence S (tokens)")
    ax.set_ylabel("speedup over 1-GPU cuDNN (steady state)")
    ax.set_title(f"Pipelined CP attention, W={world}, {meta['gpu']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pipelined.png", dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for pipelined.json / .md / .png")
    p.add_argument("--nproc", type=int, default=2, help="CP world size W (GPUs)")
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="global sequence lengths S")
    p.add_argument("--modes", nargs="+", default=["agkv", "ulysses"], help="agkv ulysses auto")
    p.add_argument("--transports", nargs="+", default=["torch", "fast"])
    p.add_argument("--chunks", nargs="+", default=["1", "2", "4"],
                   help="chunk counts ('None' = chunks=None: the measured choice, cp_ops.plan.measured; the row "
                        "reports what it picked)")
    p.add_argument("--n", type=int, default=20, help="calls back to back per sample")
    p.add_argument("--reps", type=int, default=5, help="samples (median taken)")
    p.add_argument("--max-minutes", type=float, default=3.4, help="skip configurations that would run past this")
    args = p.parse_args(argv)
    args.chunks = [None if c.lower() == "none" else int(c) for c in args.chunks]
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/pipelined.py needs CUDA GPUs")
    from cp_ops.cli.launch import launch

    launch(_worker, args.nproc, "cuda", args)


if __name__ == "__main__":
    main()
