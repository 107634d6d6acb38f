"""``cp-ops bench``: the standard CP attention microbenchmark.

For each mode, transport and global sequence length S: CP attention time (median of repeats per rank,
max over ranks), single-device SDPA time on the full sequence, speedup (single ÷ CP) and relative error
of the CP output against the single-device output (max |cp − ref| / max |ref|, max over ranks).
Dense non-causal attention, BSHD, S split evenly over the CP group.
"""

from __future__ import annotations

import json
import os
import platform

import torch
import torch.distributed as dist

from cp_ops import attention, choose_mode, local_attention, select_transport

from .timing import max_over_ranks, time_ms

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def fast_pool_gib(seqs: list[int], batch: int, heads: int, head_dim: int, dtype: torch.dtype, world_size: int) -> float:
    """GiB of the fast transport's symmetric pool that a bench over ``seqs`` fills: the pool keeps every shape
    it has seen, double-buffered — AGKV K and V ``[B, S, H, D]``, the Ulysses buffer (3 tensors) and its
    inverse (``H / W`` heads each)."""
    esz = torch.empty((), dtype=dtype).element_size()
    per_token = batch * heads * head_dim * esz * (2 + 3 / world_size + 1 / world_size)
    return 2 * sum(seqs) * per_token / 2**30


def environment(device: torch.device, world_size: int) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "world_size": world_size,
           "device": device.type}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def run_bench(rank: int, world_size: int, device: torch.device, args) -> None:
    """Rank body of ``cp-ops bench`` (see :mod:`cp_ops.cli` for the arguments)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    dtype = DTYPES[args.dtype]
    b, h, d = args.batch, args.heads, args.head_dim
    cases = []
    for s in args.seqs:
        if s % world_size:
            raise ValueError(f"--seqs: S={s} is not divisible by the CP world size {world_size}")
        for mode in args.modes:
            if mode == "ulysses" and h % world_size:
                if rank == 0:
                    print(f"skip ulysses at H={h}: CP world size {world_size} does not divide the head count")
                continue
            for tr in args.transports:
                cases.append((s, mode, tr))
    if not cases:
        raise ValueError(f"nothing to measure: no (S, mode, transport) case is valid for H={h}, W={world_size}")
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cases), desc="cp-ops bench", unit="case")
    rows, ref_cache = [], {}
    for s, mode, tr in cases:
        if bar:
            bar.set_postfix_str(f"S={s} {mode}/{tr}")
        if s not in ref_cache:
            ref_cache.clear()
            g = torch.Generator(device=device).manual_seed(1234 + s)
            q, k, v = (torch.randn(b, s, h, d, generator=g, device=device, dtype=dtype) for _ in range(3))
            ref_ms = time_ms(lambda: local_attention(q, k, v), device, args.warmup, args.repeats)
            ref = local_attention(q, k, v)
            sl = s // world_size
            shard = lambda t: t[:, rank * sl : (rank + 1) * sl].contiguous()  # noqa: E731
            ref_cache[s] = (shard(q), shard(k), shard(v), shard(ref), max_over_ranks(ref_ms, device))
            del q, k, v, ref
        ql, kl, vl, ref_l, ref_ms = ref_cache[s]
        resolved = select_transport(tr, device.type)
        fn = lambda: attention(ql, kl, vl, mode=mode, transport=tr)  # noqa: E731
        cp_ms = max_over_ranks(time_ms(fn, device, args.warmup, args.repeats), device)
        out = fn()
        err = ((out.float() - ref_l.float()).abs().max() / ref_l.float().abs().max()).item()
        err = max_over_ranks(err, device)
        rows.append(dict(S=s, mode=choose_mode(mode, h, world_size), transport=resolved, cp_ms=cp_ms,
                         single_ms=ref_ms, speedup=ref_ms / cp_ms, rel_err=err))
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    error = None
    if rank == 0:
        try:
            report(rows, dict(environment(device, world_size), dtype=args.dtype, B=b, H=h, D=d), args)
        except Exception as e:  # noqa: BLE001 - surface rank 0's error, not a peer's lost connection
            error = e
    dist.barrier()
    if error is not None:
        raise error


def report(rows: list[dict], meta: dict, args) -> None:
    where = "GPU" if meta["device"] == "cuda" else "CPU"
    print(f"\ncp-ops bench — CP{meta['world_size']} on {meta.get('gpu', meta.get('cpu', where))}, torch "
          f"{meta['torch']}, {meta['dtype']}, B={meta['B']} H={meta['H']} D={meta['D']}, times = median, max over ranks")
    head = f"{'S':>7} {'mode':>8} {'transport':>9} {'CP ms':>10} {'1-dev ms':>10} {'speedup':>8} {'rel err':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['S']:>7} {r['mode']:>8} {r['transport']:>9} {r['cp_ms']:>10.3f} {r['single_ms']:>10.3f} "
              f"{r['speedup']:>7.2f}x {r['rel_err']:>9.2e}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    if args.plot:
        plot(rows, meta, args.plot)


def plot(rows: list[dict], meta: dict, path: str) -> None:
    """Speedup over one device vs global S, a line per mode/transport (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib to get --plot; skipped")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for key in sorted({(r["mode"], r["transport"]) for r in rows}):
        pts = sorted((r["S"], r["speedup"]) for r in rows if (r["mode"], r["transport"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} / {key[1]}")
    ax.axhline(meta["world_size"], color="grey", ls="--", lw=0.8, label=f"ideal {meta['world_size']}x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global sequence length S (tokens)")
    ax.set_ylabel("speedup over 1 device")
    ax.set_title(f"CP{meta['world_size']} attention, {meta['dtype']}, H={meta['H']} D={meta['D']}")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
