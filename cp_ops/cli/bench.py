"""``cp-ops bench``: the standard CP attention microbenchmark.

For each mode, transport and global sequence length S: CP attention time (median of repeats per rank,
max over ranks), single-device SDPA time on the full sequence, speedup (single ÷ CP) and relative error
of the CP output against the single-device output (max |cp − ref| / max |ref|, max over ranks).
Dense non-causal attention, BSHD, S split evenly over the CP group. The single-device baseline runs on rank 0
alone; every time has its interquartile range beside it; the table ends with a legend.
"""

from __future__ import annotations

import json
import os
import platform

import torch
import torch.distributed as dist

from cp_ops import attention, choose_mode, local_attention, modes, select_transport

from .timing import max_over_ranks, max_over_ranks_each, samples_ms, summary

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


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _write_json(path: str, payload: dict) -> None:
    existed = os.path.exists(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}" + (" (replaced the file that was there)" if existed else ""))


def run_bench(rank: int, world_size: int, device: torch.device, args) -> None:
    """Rank body of ``cp-ops bench`` (see :mod:`cp_ops.cli.main` for the arguments).

    Per S: every rank draws the same full q, k, v; rank 0 times single-device SDPA on them while the other ranks
    wait at a barrier (no contention for cores or memory bandwidth); then every rank times CP attention on its
    shard. A call's CP time is the slowest rank's; the reported time is the median over the timed runs, with
    the interquartile range beside it.
    """
    threads = None
    if device.type == "cpu":
        cores = available_cores()
        threads = max(1, cores // world_size)
        torch.set_num_threads(threads)
        if rank == 0 and world_size * threads > cores:
            print(f"cp-ops bench: warning: {world_size} ranks x {threads} thread(s) = {world_size * threads} > "
                  f"{cores} cores here: the ranks contend for cores, so CP times are inflated and speedups "
                  "understated (use --nproc <= cores)", flush=True)
    dtype = DTYPES[args.dtype]
    b, h, d = args.batch, args.heads, args.head_dim
    cases = []
    for s in args.seqs:
        if s % world_size:
            raise ValueError(f"--seqs: S={s} is not divisible by the CP world size {world_size}")
        for mode in args.modes:
            if mode != "auto" and modes.spec(mode).needs_heads_divisible and h % world_size:
                if rank == 0:
                    print(f"skip {mode} at H={h}: CP world size {world_size} does not divide the head count")
                continue
            for tr in args.transports:
                cases.append((s, mode, tr))
    if not cases:
        raise ValueError(f"nothing to measure: no (S, mode, transport) case is valid for H={h}, W={world_size}")
    bar = None
    if rank == 0 and args.progress is not False:
        from tqdm import tqdm

        # disable=None: shown only when stderr is a terminal (no \r updates in logs), unless --progress
        bar = tqdm(total=len(cases), desc="cp-ops bench", unit="case", disable=None if args.progress is None else False)
    rows, ref_cache = [], {}
    for s, mode, tr in cases:
        if bar:
            bar.set_postfix_str(f"S={s} {mode}/{tr}")
        if s not in ref_cache:
            ref_cache.clear()
            g = torch.Generator(device=device).manual_seed(1234 + s)
            q, k, v = (torch.randn(b, s, h, d, generator=g, device=device, dtype=dtype) for _ in range(3))
            single = torch.zeros(5, dtype=torch.float64, device=device)
            dist.barrier()
            if rank == 0:  # alone: the other ranks wait at the barrier below
                st = summary(samples_ms(lambda: local_attention(q, k, v), device, args.warmup, args.repeats))
                single = torch.tensor([st[x] for x in STATS], dtype=torch.float64, device=device)
            dist.barrier()
            dist.broadcast(single, src=0)
            ref = local_attention(q, k, v)
            sl = s // world_size
            shard = lambda t: t[:, rank * sl : (rank + 1) * sl].contiguous()  # noqa: E731
            ref_cache[s] = (shard(q), shard(k), shard(v), shard(ref), dict(zip(STATS, single.tolist())))
            del q, k, v, ref
        ql, kl, vl, ref_l, single = ref_cache[s]
        resolved = select_transport(tr, device.type)
        fn = lambda: attention(ql, kl, vl, mode=mode, transport=tr)  # noqa: E731
        cp = summary(max_over_ranks_each(samples_ms(fn, device, args.warmup, args.repeats), device))
        out = fn()
        err = ((out.float() - ref_l.float()).abs().max() / ref_l.float().abs().max()).item()
        err = max_over_ranks(err, device)
        rows.append(dict(S=s, mode=choose_mode(mode, h, world_size), transport=resolved,
                         cp_ms=cp["median"], single_ms=single["median"], speedup=single["median"] / cp["median"],
                         rel_err=err,
                         cp_ms_q1=cp["q1"], cp_ms_q3=cp["q3"], cp_ms_min=cp["min"], cp_ms_max=cp["max"],
                         single_ms_q1=single["q1"], single_ms_q3=single["q3"],
                         single_ms_min=single["min"], single_ms_max=single["max"],
                         speedup_q1=single["q1"] / cp["q3"], speedup_q3=single["q3"] / cp["q1"]))
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    error = None
    if rank == 0:
        try:
            meta = dict(environment(device, world_size), dtype=args.dtype, B=b, H=h, D=d, repeats=args.repeats,
                        warmup=args.warmup, threads_per_rank=threads)
            report(rows, meta, args)
        except Exception as e:  # noqa: BLE001 - surface rank 0's error, not a peer's lost connection
            error = e
    dist.barrier()
    if error is not None:
        raise error


STATS = ("median", "min", "max", "q1", "q3")
HEADER = (f"{'S':>7} {'mode':>8} {'transport':>9} {'CP ms':>9} {'[p25–p75]':>17} {'1-dev ms':>9} "
          f"{'[p25–p75]':>17} {'speedup':>8} {'[p25–p75]':>13} {'rel err':>9}")


def legend(meta: dict) -> list[str]:
    """What the table's columns mean (printed under it)."""
    w = meta["world_size"]
    lines = [
        f"speedup = 1-device time ÷ CP time: higher is better, ideal = W = {w}. CP time of a call = the slowest rank's.",
        f"[p25–p75] = interquartile range over the {meta['repeats']} timed runs (after {meta['warmup']} warm-up); "
        "speedup's = 1-device p25 ÷ CP p75 to 1-device p75 ÷ CP p25.",
        "1-device = SDPA on the full sequence, timed on rank 0 alone while the other ranks wait.",
        "rel err = max |CP − 1-device| / max |1-device| over this rank's output, max over ranks (0 = bitwise equal).",
    ]
    if meta["device"] == "cpu":
        lines.append(f"CPU: gloo, {meta['threads_per_rank']} thread(s) per rank, and the 1-device baseline runs with "
                     "the same threads: CPU numbers are a functional check, not a performance claim.")
    return lines


def report(rows: list[dict], meta: dict, args) -> None:
    where = "GPU" if meta["device"] == "cuda" else "CPU"
    print(f"\ncp-ops bench — CP{meta['world_size']} on {meta.get('gpu', meta.get('cpu', where))}, torch "
          f"{meta['torch']}, {meta['dtype']}, B={meta['B']} H={meta['H']} D={meta['D']}, times = median [p25–p75]")
    print(HEADER)
    print("-" * len(HEADER))
    for r in rows:
        cp_iqr = f"[{r['cp_ms_q1']:.3f}–{r['cp_ms_q3']:.3f}]"
        one_iqr = f"[{r['single_ms_q1']:.3f}–{r['single_ms_q3']:.3f}]"
        sp_iqr = f"[{r['speedup_q1']:.2f}–{r['speedup_q3']:.2f}]"
        print(f"{r['S']:>7} {r['mode']:>8} {r['transport']:>9} {r['cp_ms']:>9.3f} {cp_iqr:>17} {r['single_ms']:>9.3f} "
              f"{one_iqr:>17} {r['speedup']:>7.2f}x {sp_iqr:>13} {r['rel_err']:>9.2e}")
    for line in legend(meta):
        print(line)
    if args.out:
        _write_json(args.out, {"meta": meta, "rows": rows})
    else:
        print("(no JSON written: --out PATH saves the results)")
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
