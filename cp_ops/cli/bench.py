"""``cp-ops bench``: the standard CP attention microbenchmark. Per S, mode, chunk count and transport: CP time
(steady state, the slowest rank), latency, the 1-device SDPA time, speedup, bound and relative error; what each
column means: ``--help`` and the table's :func:`legend`."""

from __future__ import annotations

import json
import os
import platform
import sys

import torch
import torch.distributed as dist

from cp_ops import attention, choose_mode, config, describe, local_attention, modes, ops as lib, select_transport
from cp_ops.comm_dtype import for_mode, parse as parse_comm_dtype, tag as comm_tag
from cp_ops.group import resolve_group

from ..timing import (Graphed, available_cores, interleaved_rounds, max_over_ranks, max_over_ranks_each, samples_ms,
                      steady_ms, summary)
from . import mesh_comm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def fast_pool_gib(seqs: list[int], batch: int, heads: int, head_dim: int, dtype: torch.dtype, world_size: int,
                  chunks: tuple = (1,)) -> float:
    """GiB of the fast transport's symmetric pool a bench over ``seqs`` fills: every shape seen, double-buffered
    (AGKV K and V, the Ulysses buffer and its inverse), plus pipelined Ulysses' head sub-groups for each chunk count
    c > 1 in ``chunks`` (None: the measured choice, which tries 2 and 4)."""
    esz = torch.empty((), dtype=dtype).element_size()
    counts = {c for c in chunks if c is not None and c > 1} | ({2, 4} if None in chunks else set())
    ulysses = (3 / world_size + 1 / world_size) * (1 + sum(min(1.0, 2 / c) for c in counts))
    per_token = batch * heads * head_dim * esz * (2 + ulysses)
    return 2 * sum(seqs) * per_token / 2**30


def environment(device: torch.device, world_size: int) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "world_size": world_size,
           "device": device.type}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    if "diffusers" in sys.modules:  # a run of a diffusers model (cp-ops run, bound)
        env["diffusers"] = sys.modules["diffusers"].__version__
    return env


def cpu_threads(rank: int, world_size: int, device: torch.device, command: str, cores: int) -> int | None:
    """On CPU: this rank's share of the ``cores`` as torch's intra-op threads (returned; None on GPU), with a warning
    from rank 0 when the ranks outnumber the cores."""
    if device.type != "cpu":
        return None
    threads = max(1, cores // world_size)
    torch.set_num_threads(threads)
    if rank == 0 and world_size * threads > cores:
        print(f"cp-ops {command}: warning: {world_size} ranks x {threads} thread(s) = {world_size * threads} > {cores} "
              "cores here: the ranks contend for cores, so CP times are inflated and speedups understated (use "
              "--nproc <= cores)", flush=True)
    return threads


def _write_json(path: str, payload: dict, quiet: bool = False) -> None:
    existed = os.path.exists(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    if not quiet:
        print(f"wrote {path}" + (" (replaced the file that was there)" if existed else ""))


def p2p_probe(k: torch.Tensor, v: torch.Tensor, transports: list[str], device: torch.device, warmup: int = 2,
              samples: int = 3, calls: int = 3) -> dict:
    """The P2P bandwidth the bound uses: the AGKV all-gather of this rank's ``k, v`` through each transport, steady
    state, max over ranks, median; GB/s = bytes each rank receives ((W−1)·2·|k|) ÷ time. Returns ``{'bytes',
    'by_transport': {name: {'ms', 'GBps'}}, 'GBps': best}`` (the same on every rank)."""
    w = dist.get_world_size()
    name = dist.group.WORLD.group_name
    recv = (w - 1) * 2 * k.numel() * k.element_size()
    out = {"bytes": recv, "by_transport": {}}
    for tr in transports:
        def gather(tr=tr):
            kf, vf = torch.ops.cp_ops.agkv_gather_start(k, v, w, name, tr)
            lib.wait(kf), lib.wait(vf)

        ms = summary(max_over_ranks_each(steady_ms(gather, device, warmup, samples, calls), device))["median"]
        out["by_transport"][tr] = {"ms": ms, "GBps": recv / ms / 1e6}
    out["GBps"] = max(x["GBps"] for x in out["by_transport"].values())
    return out


def received_bytes(mode: str, world_size: int, local_bytes: int, mesh: tuple | None = None) -> int | None:
    """Bytes each rank must receive for one call of ``mode``, given one local tensor's bytes T: AGKV 2(W−1)·T,
    Ulysses 4(W−1)/W·T, 2-D (``mesh`` = (O, I)) 4(I−1)/I·T + 2(O−1)·T; None for another mode."""
    if mode == "agkv_ulysses" and mesh is not None:
        o, i = mesh
        return 4 * (i - 1) * local_bytes // i + 2 * (o - 1) * local_bytes
    if mode == "agkv":
        return 2 * (world_size - 1) * local_bytes
    if mode == "ulysses":
        return 4 * (world_size - 1) * local_bytes // world_size
    return None


def run_bench(rank: int, world_size: int, device: torch.device, args) -> None:
    """Rank body of ``cp-ops bench`` (arguments: :mod:`cp_ops.cli.bench_args`): the P2P probe (:func:`p2p_probe`)
    at the largest S, then per S :func:`_bench_one_s` (every rank draws the same full q, k, v), then the report."""
    threads = cpu_threads(rank, world_size, device, "bench", available_cores())
    dtype = DTYPES[args.dtype]
    b, h, d = args.batch, args.heads, args.head_dim
    calls = getattr(args, "calls", 1)
    chunk_list = list(getattr(args, "chunks", None) or [1])
    pg = resolve_group(None)
    shape = getattr(args, "mesh", None)  # (O, I) with --mesh: 2-D CP on that mesh
    group = mesh_comm.build(shape, device.type) if shape is not None else None
    cases = []
    for s in args.seqs:  # multiples of W (bench_args.check)
        for mode in args.modes:
            split = shape[1] if shape is not None else world_size  # the heads are split over the (inner) group
            if mode != "auto" and modes.spec(mode).needs_heads_divisible and h % split:
                if rank == 0:
                    what = f"the mesh's inner size {split}" if shape is not None else f"CP world size {world_size}"
                    print(f"skip {mode} at H={h}: {what} does not divide the head count")
                continue
            cases += [(s, mode, tr, c) for tr in args.transports for c in ([None] if mode == "auto" else chunk_list)]
    if not cases:
        raise ValueError(f"nothing to measure: no (S, mode, transport) case is valid for H={h}, W={world_size}")
    # the bound's bandwidth: the AGKV gather at the largest S, through every transport of the run
    sl_max = max(args.seqs) // world_size
    g = torch.Generator(device=device).manual_seed(99)
    kp, vp = (torch.randn(b, sl_max, h, d, generator=g, device=device, dtype=dtype) for _ in range(2))
    probe = p2p_probe(kp, vp, sorted({select_transport(t, device.type) for t in args.transports}), device)
    del kp, vp
    bar = None
    if rank == 0 and args.progress is not False:
        from tqdm import tqdm

        # disable=None: shown only when stderr is a terminal (no \r updates in logs), unless --progress
        bar = tqdm(total=len(cases), desc="cp-ops bench", unit="case", disable=None if args.progress is None else False)
    rows = []
    graphs = bool(getattr(args, "graphs", False)) and device.type == "cuda"
    by_s: dict[int, list] = {}
    for case in cases:
        by_s.setdefault(case[0], []).append(case)
    for s, s_cases in by_s.items():
        rows += _bench_one_s(s, s_cases, rank, world_size, device, args, pg, probe, graphs, bar, group)
    if bar:
        bar.close()
    error = None
    if rank == 0:
        try:
            meta = dict(environment(device, world_size), dtype=args.dtype, B=b, H=h, D=d, repeats=args.repeats,
                        calls=calls, warmup=args.warmup, threads_per_rank=threads, p2p=probe,
                        tune_modes=config.settings.tune_modes)
            if group is not None:
                meta["mesh"] = dict(shape=list(shape), dims=list(group.mesh_dim_names), label=mesh_comm.label(group))
            report(rows, meta, args)
        except Exception as e:  # noqa: BLE001 - surface rank 0's error, not a peer's lost connection
            error = e
    dist.barrier()
    if error is not None:
        raise error


def _bench_one_s(s, s_cases, rank, world_size, device, args, pg, probe, graphs, bar, group=None) -> list[dict]:
    """The rows of one S: warm-up and the output check of every case, then ``args.repeats`` interleaved rounds
    (:func:`cp_ops.timing.interleaved_rounds`: the 1-device baselines on rank 0 alone, then one steady-state sample
    of every case), then latencies and (``--graphs``) the CUDA-graph columns."""
    dtype = DTYPES[args.dtype]
    b, h, d = args.batch, args.heads, args.head_dim
    calls = getattr(args, "calls", 1)
    g = torch.Generator(device=device).manual_seed(1234 + s)
    q, k, v = (torch.randn(b, s, h, d, generator=g, device=device, dtype=dtype) for _ in range(3))
    sl = s // world_size
    shard = lambda t: t[:, rank * sl : (rank + 1) * sl].contiguous()  # noqa: E731
    ql, kl, vl = shard(q), shard(k), shard(v)
    ref_l = shard(local_attention(q, k, v))  # every rank, untimed
    fns, errs = [], []
    fmts = parse_comm_dtype(getattr(args, "comm_dtype", "none"))
    if fmts[1] != fmts[2]:  # AGKV moves K and V in one gather: one format for both (cp_ops.comm_dtype.for_mode)
        # mode='auto' runs Ulysses then where W divides H, else AGKV (cp_ops.plan.rules.fp8_mode): skipped too
        agkv = [case for case in s_cases if case[1] == "agkv" or (case[1] == "auto" and h % world_size)]
        if rank == 0 and agkv:
            print(f"cp-ops bench: S={s}: {'/'.join(sorted({m for _, m, _, _ in agkv}))} rows skipped: --comm-dtype "
                  f"{args.comm_dtype} puts K and V in different formats, and AGKV gathers them together", flush=True)
        s_cases = [case for case in s_cases if case not in agkv]
    wire = None if group is not None else fmts  # a mesh: --comm-dtype refused by the CLI checks (no FP8 mesh rows)
    for _, mode, tr, c in s_cases:
        if bar:
            bar.set_postfix_str(f"S={s} {mode}/{tr}/c={'auto' if c is None else c}")
        fn = lambda mode=mode, tr=tr, c=c: attention(ql, kl, vl, group=group, mode=mode,  # noqa: E731
                                                     transport=tr, chunks=c, comm_dtype=wire)
        out = fn()
        err = ((out.float() - ref_l.float()).abs().max() / ref_l.float().abs().max()).item()
        errs.append(max_over_ranks(err, device))
        for _ in range(args.warmup):
            fn()
        fns.append(fn)
        del out
    full = lambda: local_attention(q, k, v)  # noqa: E731
    q0 = ql if rank == 0 else None
    share_fn = lambda: local_attention(q0, k, v)  # noqa: E731
    dist.barrier()
    if rank == 0:  # alone: the other ranks wait at the barrier below
        for _ in range(args.warmup):
            full()
            share_fn()
    dist.barrier()
    # interleaved rounds: the baselines (rank 0 alone), then every case once; the cases of this S finish together,
    # after the last round, so the bar says where the rounds are
    progress = (lambda i: bar.set_postfix_str(f"S={s} round {i + 1}/{args.repeats} of {len(fns)} case(s)")) if bar \
        else None
    (single_s, share_s), cp_s = interleaved_rounds([full, share_fn], fns, args.repeats,
                                                   lambda fn: steady_ms(fn, device, 0, 1, calls)[0], progress)
    dist.barrier()  # rank 0's latency runs below start once every rank's last case sample is over
    base = torch.zeros(3 * len(STATS) + 1, dtype=torch.float64, device=device)
    if rank == 0:
        lat = summary(samples_ms(full, device, 0, args.repeats))
        graphed = 0.0
        if graphs:
            try:  # rank 0 alone: a failure must not leave it out of the barrier the others wait at
                graphed = _graph_ms(full, device, args, calls)
            except Exception as e:  # noqa: BLE001 - no 1-device graph: the graph columns say so
                graphed = float("nan")
                print(f"cp-ops bench: S={s}: 1-device CUDA-graph capture failed: {type(e).__name__}: {e}", flush=True)
        base = torch.tensor([x[n] for x in (summary(single_s), lat, summary(share_s)) for n in STATS] + [graphed],
                            dtype=torch.float64, device=device)
    dist.barrier()
    dist.broadcast(base, src=0)
    vals = base.tolist()
    n = len(STATS)
    single, single_lat, share = (dict(zip(STATS, vals[i * n:(i + 1) * n])) for i in range(3))
    single["graph"] = vals[-1]
    # a mesh: each dim's collectives timed alone, per transport (cp_ops.cli.mesh_comm)
    by_dim = {tr: mesh_comm.dim_times(group, b, sl, h, d, dtype, tr, device, 1, args.repeats, calls)
              for tr in sorted({case[2] for case in s_cases})} if group is not None else {}
    rows = []
    for (_, mode, tr, c), fn, err, samples in zip(s_cases, fns, errs, cp_s):
        resolved = select_transport(tr, device.type)
        cp = summary(max_over_ranks_each(samples, device))
        lat = summary(max_over_ranks_each(samples_ms(fn, device, 0, args.repeats), device))
        asked = mode == "auto" or c is None or group is not None  # a mesh: what it ran (a degenerate one: 1-D)
        on = pg if group is None else group
        picked = describe(ql, group=on, mode=mode, transport=tr, chunks=c, comm_dtype=wire) if asked else None
        used_mode = picked.mode if picked else choose_mode(mode, h, world_size)
        used_chunks = picked.chunks if picked else c
        graph = {}
        if graphs:  # after the eager calls above: plans, tuning, the fast lane's buffers are ready for capture
            try:
                graph["graph_cp_ms"] = max_over_ranks(_graph_ms(fn, device, args, calls, pg), device)
                ok = single["graph"] == single["graph"]  # NaN: the 1-device capture failed
                graph["graph_single_ms"] = single["graph"] if ok else None
                graph["graph_speedup"] = single["graph"] / graph["graph_cp_ms"] if ok else None
            except RuntimeError as e:  # the capture failed (on some rank; every rank is told): no graph column
                graph["graph_skipped"] = str(e)
                if rank == 0:
                    print(f"cp-ops bench: S={s} {mode}/{tr}/c={c}: no graph row: {e}", flush=True)
        recv = received_bytes(used_mode, world_size, ql.numel() * ql.element_size(), getattr(args, "mesh", None))
        if recv is not None and any(fmts):  # FP8 rows: D + 4 bytes per (token, head) instead of D elements
            moved = "kv" if used_mode == "agkv" else "qkvo"
            ratio = sum((d + 4) / (d * ql.element_size()) if fmts["qkvo".index(n)] else 1.0 for n in moved) / len(moved)
            recv = int(recv * ratio)
        comm_ms = None if recv is None else recv / probe["GBps"] / 1e6
        # on CPU gloo's copies through host memory are not a link's limit: the bound is the attention share alone
        bound = max(share["median"], comm_ms or 0.0) if device.type == "cuda" else share["median"]
        rows.append(dict(S=s, mode=used_mode, chunks=used_chunks, requested_mode=mode,
                         requested_chunks="auto" if c is None else c, choice=picked.source if picked else "explicit",
                         choice_times_ms=dict(picked.times_ms) if picked else {}, transport=resolved, requested_transport=tr,
                         cp_ms=cp["median"], single_ms=single["median"], speedup=single["median"] / cp["median"],
                         rel_err=err, comm_dtype=comm_tag(for_mode(fmts, used_mode)) or "none",
                         cp_ms_q1=cp["q1"], cp_ms_q3=cp["q3"], cp_ms_min=cp["min"], cp_ms_max=cp["max"],
                         cp_latency_ms=lat["median"], cp_latency_ms_q1=lat["q1"], cp_latency_ms_q3=lat["q3"],
                         single_ms_q1=single["q1"], single_ms_q3=single["q3"],
                         single_ms_min=single["min"], single_ms_max=single["max"],
                         single_latency_ms=single_lat["median"],
                         speedup_q1=single["q1"] / cp["q3"], speedup_q3=single["q3"] / cp["q1"],
                         attn_share_ms=share["median"], recv_bytes=recv, comm_ms=comm_ms, bound_ms=bound,
                         bound_pct=100.0 * bound / cp["median"], bound_speedup=single["median"] / bound, **graph,
                         **({} if group is None else dict(ulysses_comm_ms=by_dim[tr]["ulysses"],
                                                          agkv_comm_ms=by_dim[tr]["agkv"],
                                                          comm_ms_by_dim=dict(by_dim[tr])))))
        if bar:
            bar.update(1)
    return rows


def _graph_ms(fn, device: torch.device, args, calls: int, group=None) -> float:
    """Steady-state ms per call of ``fn`` replayed from a CUDA graph of one call (:class:`cp_ops.timing.Graphed`):
    ``calls`` replays back to back per sample, median of ``args.repeats`` samples. Raises RuntimeError when the
    capture fails (with ``group``: on every rank)."""
    g = Graphed(fn, device, calls=1, warmup=2, group=group)
    try:
        return summary(steady_ms(g, device, 1, args.repeats, calls))["median"]
    finally:
        del g
        torch.cuda.synchronize(device)


STATS = ("median", "min", "max", "q1", "q3")
MESH_COLUMNS = f" {'ulysses ms':>10} {'agkv ms':>9}"
HEADER = (f"{'S':>7} {'mode':>13} {'chunks':>6} {'transport':>10} {'CP ms':>9} {'[p25–p75]':>17} {'lat ms':>8} "
          f"{'1-dev ms':>9} {'speedup':>8} {'[p25–p75]':>13} {'bound ms':>9} {'%bound':>6} {'rel err':>9}")


def legend(meta: dict) -> list[str]:
    """What the table's columns mean (printed under it)."""
    w = meta["world_size"]
    p2p = meta["p2p"]
    probes = ", ".join(f"{t} {x['GBps']:.3g} GB/s" for t, x in p2p["by_transport"].items())
    lines = [
        f"speedup = 1-device time ÷ CP time: higher is better, ideal = W = {w}. CP time of a call = the slowest rank's.",
        f"CP ms = steady state: {meta['calls']} call(s) back to back between two "
        + ("CUDA events" if meta["device"] == "cuda" else "perf_counter reads")
        + " (the host runs ahead, as consecutive layers do), per call; "
        f"[p25–p75] = interquartile range over the {meta['repeats']} samples (after {meta['warmup']} warm-up calls); "
        "speedup's = 1-device p25 ÷ CP p75 to 1-device p75 ÷ CP p25.",
        f"lat ms = latency of one call waited for on its own (median of {meta['repeats']}; host launch cost included).",
        "1-device = SDPA on the full sequence, timed the same way (steady state) on rank 0 alone while the other "
        f"ranks wait, in {meta['repeats']} rounds interleaved with the CP samples (each round: 1-device, then one "
        "sample of every row of that S).",
        (f"bound = max(SDPA at one rank's share: S/W queries x S keys, timed like 1-device; bytes each rank receives "
         f"(AGKV 2(W-1), Ulysses 4(W-1)/W local tensors) ÷ P2P bandwidth {p2p['GBps']:.3g} GB/s = best AGKV gather "
         f"measured in this run at the largest S: {probes}); %bound = bound ÷ CP ms (100% = at the physical limit).")
        if meta["device"] == "cuda" else
        ("bound = SDPA at one rank's share (S/W queries x S keys, timed like 1-device); on CPU the transfer term is "
         "left out (gloo's copies through host memory are not a link's limit; comm_ms in the JSON has it); "
         "%bound = bound ÷ CP ms."),
        "auto→X = what mode='auto' and/or chunks=None picked (--modes auto, --chunks auto): "
        + ("measured (CP_OPS_TUNE_MODES=1, cp_ops.plan.measured)." if meta.get("tune_modes", False)
           else "the heuristic (cp_ops.plan.rules.mode_rule, chunks_rule; measuring: CP_OPS_TUNE_MODES=1)."),
        "rel err = max |CP − 1-device| / max |1-device| over this rank's output, max over ranks (0 = bitwise equal).",
    ]
    if meta["device"] == "cpu":
        lines.append(f"CPU: gloo, {meta['threads_per_rank']} thread(s) per rank, and the 1-device baseline runs with "
                     "the same threads: CPU numbers are a functional check, not a performance claim.")
    return lines


def report(rows: list[dict], meta: dict, args) -> None:
    where = "GPU" if meta["device"] == "cuda" else "CPU"
    print(f"\ncp-ops bench — CP{meta['world_size']}" + (f" on a {meta['mesh']['label']}" if "mesh" in meta else "")
          + f" on {meta.get('gpu', meta.get('cpu', where))}, torch "
          f"{meta['torch']}, {meta['dtype']}, B={meta['B']} H={meta['H']} D={meta['D']}"
          + (f", comm_dtype={args.comm_dtype} (FP8 on the wire: not bitwise)"
             if getattr(args, "comm_dtype", "none") not in (None, "none") else "")
          + ", times = median [p25–p75]")
    graphed = any("graph_cp_ms" in r or "graph_skipped" in r for r in rows)
    meshed = "mesh" in meta
    header = HEADER + (f" {'graph CP ms (speedup)':>22}" if graphed else "") + (MESH_COLUMNS if meshed else "")
    print(header)
    print("-" * len(header))
    for r in rows:
        cp_iqr = f"[{r['cp_ms_q1']:.3f}–{r['cp_ms_q3']:.3f}]"
        sp_iqr = f"[{r['speedup_q1']:.2f}–{r['speedup_q3']:.2f}]"
        mode, chunks, tr = (f"auto→{r[k]}" if r.get(f"requested_{k}") == "auto" else str(r[k])
                            for k in ("mode", "chunks", "transport"))
        print(f"{r['S']:>7} {mode:>13} {chunks:>6} {tr:>10} {r['cp_ms']:>9.3f} {cp_iqr:>17} "
              f"{r['cp_latency_ms']:>8.3f} {r['single_ms']:>9.3f} {r['speedup']:>7.2f}x {sp_iqr:>13} "
              f"{r['bound_ms']:>9.3f} {r['bound_pct']:>5.0f}% {r['rel_err']:>9.2e}"
              + (f" {_graph_cell(r):>22}" if graphed else "")
              + (f" {r['ulysses_comm_ms']:>10.3f} {r['agkv_comm_ms']:>9.3f}" if meshed else ""))
    tuned = any("auto" in (r["requested_mode"], r["requested_chunks"]) for r in rows)
    if graphed:
        print("graph = the same call captured in a CUDA graph, replays back to back (no host launch cost), "
              "speedup over the 1-device SDPA captured the same way; 'failed' = the capture failed (JSON: "
              "graph_skipped).")
    if meshed:
        print("ulysses ms / agkv ms = each dim's collectives of one call timed alone (same shapes, group and transport "
              "as the call; the other dim and the attention idle), steady state, the slowest rank, median: the inner "
              "all-to-all of Q, K, V plus the inverse one of the output; the outer all-gather of the Ulysses-local "
              "K and V. 0 = a dim of size 1 (docs/2d.md).")
    for line in legend(meta):
        if tuned or not line.startswith("auto→X"):  # the auto legend only where an auto row is shown
            print(line)
    if args.out:
        _write_json(args.out, {"meta": meta, "rows": rows})
    else:
        print("(no JSON written: --out PATH saves the results)")
    if args.plot:
        plot(rows, meta, args.plot)


def _graph_cell(r: dict) -> str:
    if "graph_cp_ms" in r:
        sp = "-" if r.get("graph_speedup") is None else f"{r['graph_speedup']:.2f}x"
        return f"{r['graph_cp_ms']:.3f} ({sp})"
    return "failed" if "graph_skipped" in r else "-"


def plot(rows: list[dict], meta: dict, path: str) -> None:
    """PNG: speedup over one device vs global S, a line per mode/chunks/transport, per mode the bound's (dashed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib to get --plot; skipped")
        return
    fig, ax = plt.subplots(figsize=(10.5, 4.8))

    def label(r):
        m = "auto" if r["requested_mode"] == "auto" else r["mode"]
        return (m, str(r["requested_chunks"]), r["transport"])

    for col, marker, ls, what in (("speedup", "o", "-", ""), ("graph_speedup", "x", ":", " (CUDA graph)")):
        for key in sorted({label(r) for r in rows if r.get(col) is not None}):
            pts = sorted((r["S"], r[col]) for r in rows if label(r) == key and r.get(col) is not None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, ls=ls,
                    label=f"{key[0]} c={key[1]} / {key[2]}{what}")
    for m in sorted({r["mode"] for r in rows if r["recv_bytes"] is not None}):
        pts = sorted({(r["S"], r["bound_speedup"]) for r in rows if r["mode"] == m})
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="--", lw=1.2, color="black" if m == "agkv" else "grey",
                marker="_" if len(pts) == 1 else None, markersize=14,  # a mode at one S: a point, not no line
                label=f"bound {m}")
    ax.axhline(meta["world_size"], color="grey", ls=":", lw=0.8, label=f"ideal {meta['world_size']}x")
    ax.set_xscale("log", base=2)
    seqs = sorted({r["S"] for r in rows})
    ax.minorticks_off()
    ax.set_xticks(seqs, [str(x) for x in seqs])  # the measured S, as the table prints them (75600 is no power of 2)
    ax.set_xlabel("global sequence length S (tokens)")
    ax.set_ylabel("speedup over 1 device (steady state)")
    ax.set_title(f"CP{meta['world_size']} attention, {meta['dtype']}, H={meta['H']} D={meta['D']}")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes: lines stay visible
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
