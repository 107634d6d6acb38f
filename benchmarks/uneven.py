"""What uneven shards and key-padding masks cost (issue 10 items 3-4): cp_ops.attention with ``seq_lens`` /
``key_mask`` vs the even call, and vs one GPU.

Workload: bf16, B=1, H=40, D=128, dense non-causal; per global size S (a multiple of W), five CP calls per mode and
transport: ``even`` (S, no new argument: the even path), ``even+seq_lens`` (S, ``seq_lens`` given: the uneven path on
equal shards), ``uneven`` (S+1 tokens, :func:`cp_ops.layout.shard_sizes`), ``mask`` (S, a key mask with the last 10%
of the keys padding), ``uneven+mask`` (S+1 and the mask). Baselines: single-GPU SDPA over the whole sequence
(:func:`cp_ops.local_attention`, or :func:`cp_ops.local_attention (key_mask=)` for the masked rows), timed in the
same run. Steady state: warm-up, then N calls back to back between two CUDA events; median over samples; max over
ranks. Each configuration's output is checked against the single-GPU output (max relative error, bf16).

Usage (2 GPUs): ``python benchmarks/uneven.py --out DIR [--nproc 2] [--sizes 16384 32768]``; writes
``DIR/uneven.json`` and ``DIR/uneven.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cp_ops import timing  # noqa: E402

B, H, D = 1, 40, 128
CASES = ("even", "even+seq_lens", "uneven", "mask", "uneven+mask")


def _max(x: float) -> float:
    t = torch.tensor([x], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _steady_ms(fn, n: int, reps: int) -> float:
    """Median over ``reps`` samples of ``n`` back-to-back calls per sample (ranks aligned), max over ranks."""
    return _max(statistics.median(timing.steady_ms(fn, torch.device("cuda"), 3, reps, n, align=True)))


def _worker(rank: int, world: int, dev: torch.device, args) -> None:
    import cp_ops
    from cp_ops import layout
    from cp_ops.kernels import local_attention as masked_attention
    from cp_ops.transport import base as transport_base

    transports = [t for t in args.transports if transport_base.get(t).unavailable_reason(dev) is None]
    rows = []
    for s in args.sizes:
        s -= s % world
        for case in CASES:
            total = s + 1 if case.startswith("uneven") else s
            seq = layout.shard_sizes(total, world)
            g = torch.Generator(device=dev).manual_seed(total)
            q, k, v = (torch.randn(B, total, H, D, generator=g, device=dev, dtype=torch.bfloat16) for _ in range(3))
            mask = None
            if "mask" in case:
                mask = torch.ones(B, total, dtype=torch.bool, device=dev)
                mask[:, total - total // 10:] = False
            one_gpu = _steady_ms(lambda: masked_attention(q, k, v, None, mask), args.n, args.reps)
            sh = lambda t: layout.shard(t, 1, rank, world).contiguous()  # noqa: E731
            ref = sh(masked_attention(q, k, v, None, mask)).float()
            ql, kl, vl = sh(q), sh(k), sh(v)
            ml = None if mask is None else sh(mask)
            del q, k, v
            kw = {} if case == "even" else {"seq_lens": seq, "key_mask": ml}
            for transport in transports:
                for mode in args.modes:
                    def call(mode=mode, transport=transport):
                        return cp_ops.attention(ql, kl, vl, mode=mode, transport=transport, chunks=1, **kw)

                    out = call()
                    err = _max(((out.float() - ref).abs().max() / ref.abs().max()).item())
                    ms = _steady_ms(call, args.n, args.reps)
                    rows.append({"S": total, "case": case, "mode": mode, "transport": transport, "ms": ms,
                                 "one_gpu_ms": one_gpu, "speedup": one_gpu / ms, "max_rel_err": err})
                    if rank == 0:
                        print(f"S={total:6d} {case:14s} {mode:8s} {transport:5s} {ms:.3f} ms ({one_gpu / ms:.2f}x of "
                              f"1 GPU {one_gpu:.3f} ms) max rel err {err:.1e}", flush=True)
            del ql, kl, vl, ref
            torch.cuda.empty_cache()
    if rank == 0:
        _write(args, world, rows)


def _write(args, world: int, rows: list) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "W": world, "B": B, "H": H, "D": D,
            "dtype": "bfloat16", "n_calls": args.n, "samples": args.reps}
    (out / "uneven.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Uneven shards and key masks, W={world}, {meta['gpu']}, torch {meta['torch']}, {meta['date']}", "",
             f"bf16 B={B} H={H} D={D}, chunks=1; steady state (N={args.n}, {args.reps} samples, max over ranks). "
             "Cells: CP ms (speedup over the same-run 1-GPU SDPA, masked where the case is) [overhead vs the even "
             "call of that mode/transport/S].", "",
             "| S | case | " + " | ".join(f"{m} {t}" for t in args.transports for m in args.modes) + " |",
             "|---|---|" + "---|" * (len(args.transports) * len(args.modes))]
    base = {(r["S"], r["mode"], r["transport"]): r["ms"] for r in rows if r["case"] == "even"}
    for (s, case) in dict.fromkeys((r["S"], r["case"]) for r in rows):
        cells = []
        for t in args.transports:
            for m in args.modes:
                r = next((r for r in rows if (r["S"], r["case"], r["mode"], r["transport"]) == (s, case, m, t)), None)
                if r is None:
                    cells.append("—")
                    continue
                even = base.get((s - s % world, m, t))
                over = f" [{100 * (r['ms'] / even - 1):+.1f}%]" if even and case != "even" else ""
                cells.append(f"{r['ms']:.3f} ({r['speedup']:.2f}x){over} err {r['max_rel_err']:.1e}")
        lines.append(f"| {s} | {case} | " + " | ".join(cells) + " |")
    (out / "uneven.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for uneven.json / uneven.md")
    p.add_argument("--nproc", type=int, default=2, help="CP world size W (GPUs)")
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768], help="global sequence lengths S")
    p.add_argument("--modes", nargs="+", default=["agkv", "ulysses"])
    p.add_argument("--transports", nargs="+", default=["torch", "fast"])
    p.add_argument("--n", type=int, default=20, help="calls back to back per sample")
    p.add_argument("--reps", type=int, default=5, help="samples (median taken)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/uneven.py needs CUDA GPUs")
    from cp_ops.cli.launch import launch

    launch(_worker, args.nproc, "cuda", args)


if __name__ == "__main__":
    main()
