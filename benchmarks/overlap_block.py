#!/usr/bin/env python3
"""Benchmark of the overlap pass on a Wan-14B-shape attention block: how much K/V communication stays exposed.

The block (as in Wan 2.1 14B self-attention): Q/K/V projections (dim 5120), RMSNorm over dim on q and k,
3-D RoPE, attention over 40 heads of D=128, output projection; bf16, ``torch.compile``'d. For each mode
(AGKV, Ulysses) and global sequence length S, four compiled variants, each timed with CUDA events (warm-up,
median of the repeats, max over ranks):

    1 GPU      the block on all S tokens, one device, local attention
    CP         the block on S/W tokens per rank with ``cp_ops.attention``, compiled without the pass
    CP+pass    the same, compiled with ``cp_ops.compile`` (the K/V communication overlap pass)
    CP copy    the same block with every communication replaced by a local copy of equal size (compute only)

Reported: block time, speedup over 1 GPU, exposed communication = CP time − CP-copy time (ms and % of the CP
block time), the reduction of exposed communication by the pass, and, from a ``torch.profiler`` trace of each
CP variant read back here, the fraction of communication-kernel time (NCCL) that overlaps compute kernels.
Targets checked: with the pass, exposed communication <= 5% of block time at S >= 8K, and at S = 4K at least
60% less exposed communication than without the pass.

Writes ``overlap_block.json`` (+ ``overlap_block.png`` with matplotlib) to ``--out``. Launches its own ranks
(``cp_ops.cli.launch.launch``; or joins a ``torchrun`` launch). ``--device cpu`` is a smoke run with tiny shapes
on gloo (times there say nothing about GPUs).

    python benchmarks/overlap_block.py --out results/                 # 2 GPUs, S = 4K..32K, both modes
    python benchmarks/overlap_block.py --device cpu --out /tmp/ob     # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import platform
import re
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the reference blocks (tests/blocks.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cp_ops  # noqa: E402
from blocks import WanBlock, rope_tables  # noqa: E402  (tests/blocks.py: the blocks the pass tests use too)
from cp_ops import layout  # noqa: E402
from cp_ops.cli.launch import launch  # noqa: E402
from cp_ops.timing import max_over_ranks, time_ms  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VARIANTS = ("single", "cp", "cp_pass", "copy")


# ---- comm replaced by local copies of equal size (custom ops: Inductor cannot fuse them away) -------------
@torch.library.custom_op("cp_bench::local_gather", mutates_args=())
def local_gather(k: torch.Tensor, v: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AGKV stand-in: ``[B, S, H, D]`` → ``[B, W*S, H, D]`` by copying (the bytes an all-gather writes)."""
    return k.repeat(1, world_size, 1, 1), v.repeat(1, world_size, 1, 1)


@local_gather.register_fake
def _(k, v, world_size):
    b, s, h, d = k.shape
    return k.new_empty(b, world_size * s, h, d), v.new_empty(b, world_size * s, h, d)


@torch.library.custom_op("cp_bench::local_a2a", mutates_args=())
def local_a2a(xs: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """Ulysses stand-in: the packed send buffer ``[W, B, S, n, H/W, D]``, copied once more (the receive)."""
    return layout.ulysses_pack(xs, world_size).clone()


@local_a2a.register_fake
def _(xs, world_size):
    b, s, h, d = xs[0].shape
    return xs[0].new_empty(world_size, b, s, len(xs), h // world_size, d)


@torch.library.custom_op("cp_bench::local_a2a_inverse", mutates_args=())
def local_a2a_inverse(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Ulysses inverse stand-in: ``[B, S, H/W, D]`` → ``[W, B, S/W, H/W, D]`` by copying."""
    return layout.ulysses_inverse_pack(x, world_size).clone()


@local_a2a_inverse.register_fake
def _(x, world_size):
    b, s, hl, d = x.shape
    return x.new_empty(world_size, b, s // world_size, hl, d)


def copy_attention(q, k, v, *, mode: str, world_size: int):
    """Local attention with the same shapes and copies as CP attention, but no communication."""
    if mode == "agkv":
        k_full, v_full = torch.ops.cp_bench.local_gather(k, v, world_size)
        return cp_ops.local_attention(q, k_full, v_full)
    buf = torch.ops.cp_bench.local_a2a([q, k, v], world_size)
    qh, kh, vh = (layout.ulysses_unpack(buf, i) for i in range(3))
    out = cp_ops.local_attention(qh, kh, vh)
    return layout.ulysses_inverse_unpack(torch.ops.cp_bench.local_a2a_inverse(out, world_size))


# ---- timing and the profiler trace --------------------------------------------------------------------------


# cp_ops' fast transport (csrc/cp_fast.cu): SM copy and flag kernels; its copy-engine path shows as memcpy PtoP.
_FAST_KERNELS = re.compile(r"\b(copy2d|begin|wait_all|wait|signal)_kernel\b")


def _is_comm(name: str) -> bool:
    n = name.lower()
    return "nccl" in n or "gloo" in n or "memcpy ptop" in n or bool(_FAST_KERNELS.search(name))


def _union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap_fraction(trace_path: str) -> dict:
    """Read a ``torch.profiler`` chrome trace; the fraction of communication time that overlaps compute.

    GPU: communication = NCCL kernels, the fast transport's copy/flag kernels and peer-to-peer memcpys;
    compute = every other kernel. CPU (smoke): communication = gloo events; compute = aten ops. Returns
    ``{"comm_ms", "overlap_ms", "fraction"}`` (fraction None when there is no communication event).
    """
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    gpu = any(e.get("cat") == "kernel" for e in events)
    comm, compute = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        name, cat = e.get("name", ""), e.get("cat", "")
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if gpu:
            if cat == "kernel":
                (comm if _is_comm(name) else compute).append(span)
            elif cat == "gpu_memcpy" and "ptop" in name.lower():
                comm.append(span)
        elif "gloo" in name.lower():  # CPU: 'gloo:all_gather' annotations (the transfer, on gloo's thread)
            comm.append(span)
        elif cat == "cpu_op" and name.startswith("aten::"):
            compute.append(span)
    comm_u, comp_u = _union(comm), _union(compute)
    total = sum(e - s for s, e in comm_u)
    inter, j = 0.0, 0
    for s, e in comm_u:
        while j < len(comp_u) and comp_u[j][1] <= s:
            j += 1
        k = j
        while k < len(comp_u) and comp_u[k][0] < e:
            inter += max(0.0, min(e, comp_u[k][1]) - max(s, comp_u[k][0]))
            k += 1
    return {"comm_ms": total / 1e3, "overlap_ms": inter / 1e3, "fraction": (inter / total) if total > 0 else None}


def profile_overlap(fn, device: torch.device, iters: int, path: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(path)
    return overlap_fraction(path)


# ---- one rank -----------------------------------------------------------------------------------------------
def _build(args, variant: str, mode: str, world_size: int, device, dtype, fullgraph: bool = True):
    torch.manual_seed(0)  # the same weights on every rank and in every variant
    attention = None
    if variant == "copy":
        attention = functools.partial(copy_attention, mode=mode, world_size=world_size)
    block = WanBlock(args.dim, args.heads, cp=variant != "single", mode=mode, transport=args.transport, attention=attention)
    block = block.to(device=device, dtype=dtype).eval()
    torch._dynamo.reset()
    if variant in ("cp", "cp_pass"):
        return cp_ops.compile(block, fullgraph=fullgraph, overlap=variant == "cp_pass")
    return torch.compile(block, fullgraph=fullgraph)


def _inputs(s_tokens: int, offset: int, args, device, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, s_tokens, args.dim, generator=g).to(device=device, dtype=dtype)
    cos, sin = rope_tables((1, args.grid_hw, args.grid_hw), args.dim // args.heads, offset, s_tokens)
    cos, sin = cos.to(device), sin.to(device)
    if args.dynamic:  # one compile serves every S
        torch._dynamo.mark_dynamic(x, 1)
        torch._dynamo.mark_dynamic(cos, 0)
        torch._dynamo.mark_dynamic(sin, 0)
    return x, cos, sin


def _agree(flag: bool, device) -> bool:
    """True on every rank iff it is True on rank 0 (ranks must take the same branch)."""
    t = torch.tensor([1 if flag else 0], device=device)
    dist.broadcast(t, 0)
    return bool(t.item())


def _measure(f, args, device, name: str, inputs, trace_path: str | None) -> dict:
    """Time ``f(*inputs)`` (max over ranks); optionally trace it and read the overlap fraction."""
    out = {}
    with torch.no_grad():
        out[f"{name}_ms"] = max_over_ranks(time_ms(lambda: f(*inputs), device, args.warmup, args.repeats), device)
        if trace_path is not None:
            ov = profile_overlap(lambda: f(*inputs), device, args.profile_iters, trace_path)
            frac = ov["fraction"]
            t = torch.tensor([-1.0 if frac is None else frac], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)  # the least-overlapped rank
            out[f"{name}_overlap_frac"] = None if t.item() < 0 else float(t.item())
            out[f"{name}_comm_kernel_ms"] = ov["comm_ms"] / args.profile_iters
            if not args.keep_traces:
                os.remove(trace_path)
    return out


class _PassLog(logging.Handler):
    """Counts the overlap pass's log lines (windows opened / pinned) while a variant compiles."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.opened = self.pinned = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.opened += bool(re.search(r"window \d+: ", msg)) and "fused projection" not in msg
        self.pinned += "pinned in the scheduler" in msg


def window_kernels(code: str) -> list[list[str]]:
    """From Inductor's generated code: for each cp_ops launch, the kernels called before its first wait."""
    pat = re.compile(r"(extern_kernels\.\w+|triton_\w+|cpp_fused\w*|torch\.ops\.[\w.]+)(?:\.run)?\(")
    calls = [m.group(1) for line in code.splitlines() if "assert" not in line for m in [pat.search(line)] if m]
    windows, cur = [], None
    for c in calls:
        if c.startswith("torch.ops.cp_ops.") and c.endswith(("agkv_gather_start.default", "ulysses_start.default",
                                                            "ulysses_packed_start.default")) and cur is None:
            cur = []
        elif "wait_tensor" in c and cur is not None:
            windows.append(cur)
            cur = None
        elif cur is not None:
            cur.append(c)
    return windows


def _first_call_with_code(f, inputs, path: str | None) -> list[list[str]]:
    """First (compiling) call through ``run_and_get_code``; writes the code to ``path``; returns window_kernels."""
    from torch._inductor.utils import run_and_get_code

    with torch.no_grad():
        _, codes = run_and_get_code(f, *inputs)
    code = "\n".join(codes)
    if path:
        with open(path, "w") as fh:
            fh.write(code)
    return window_kernels(code)


def run_rank(rank: int, world_size: int, device: torch.device, args) -> None:
    """Rank body: for each mode, each variant is compiled once (dynamic S) and timed at every S."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    dtype = DTYPES[args.dtype]
    t_start = time.time()
    seqs = [s for s in args.seqs if s % world_size == 0]
    skipped = [{"S": s, "mode": "*", "reason": f"S not divisible by W={world_size}"} for s in args.seqs if s % world_size]
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="overlap_block_traces_")
    results: dict[tuple[str, int], dict] = {}
    single: dict[int, float] = {}
    plan = [("single", None)] + [(v, m) for m in args.modes for v in ("copy", "cp", "cp_pass")]
    for variant, mode in plan:
        if mode == "ulysses" and args.heads % world_size:
            skipped.append({"S": "*", "mode": mode, "reason": f"H={args.heads} not divisible by W={world_size}"})
            continue
        if _agree((time.time() - t_start) / 60 > args.max_minutes, device):
            skipped.append({"S": "*", "mode": mode or "*", "reason": f"{variant}: time budget --max-minutes {args.max_minutes} spent"})
            continue
        f, info, fullgraph = None, {}, True
        for attempt in (1, 2):  # compile (first call); on an error, once more with fullgraph=False
            try:
                f = _build(args, variant, mode or "agkv", world_size, device, dtype, fullgraph=fullgraph)
                s0 = seqs[0] if variant == "single" else seqs[0] // world_size
                first = _inputs(s0, 0 if variant == "single" else rank * s0, args, device, dtype, seed=rank + 1)
                plog = _PassLog()
                logging.getLogger("cp_ops.passes").setLevel(logging.DEBUG)
                logging.getLogger("cp_ops.passes").addHandler(plog)
                try:
                    code_path = os.path.join(args.out, f"code_{variant}_{mode or 'single'}.py") if rank == 0 else None
                    wins = _first_call_with_code(f, first, code_path)
                finally:
                    logging.getLogger("cp_ops.passes").removeHandler(plog)
                if variant in ("cp", "cp_pass"):
                    info = {f"{variant}_windows_opened": plog.opened, f"{variant}_windows_pinned": plog.pinned,
                            f"{variant}_kernels_in_window": [len(w) for w in wins]}
                    if rank == 0:
                        print(f"  {variant} {mode}: windows opened {plog.opened}, pinned {plog.pinned} (0 on an FX "
                              f"graph cache hit), kernels between launch and wait {[len(w) for w in wins]}: {wins}",
                              flush=True)
                if not fullgraph:
                    info[f"{variant}_fullgraph"] = False
                break
            except Exception as e:  # noqa: BLE001 - compile errors are the same on every rank: ranks stay in step
                f = None
                msg = f"{variant}/{mode} compile (fullgraph={fullgraph}): {type(e).__name__}: {e}"[:2000]
                print(f"[rank {rank}] {msg}", flush=True)
                traceback.print_exc()
                fullgraph = False  # e.g. a graph break on this torch: retry, and say so in the results
        if f is None:
            for s in seqs:
                if variant != "single":
                    results.setdefault((mode, s), {"S": s, "mode": mode, "S_local": s // world_size})["error"] = msg
            continue
        for s in seqs:
            s_local = s // world_size
            row = None if variant == "single" else results.setdefault((mode, s), {"S": s, "mode": mode, "S_local": s_local})
            try:
                if variant == "single":
                    single[s] = _measure(f, args, device, "single", _inputs(s, 0, args, device, dtype, seed=99), None)["single_ms"]
                    if rank == 0:
                        print(f"   single         S={s:>6}: {single[s]:.3f} ms", flush=True)
                    continue
                inputs = _inputs(s_local, rank * s_local, args, device, dtype, seed=rank + 1)
                trace = None
                if variant != "copy" and not args.no_profile:
                    trace = os.path.join(trace_dir, f"trace_{mode}_{s}_{variant}_rank{rank}.json")
                row.update(_measure(f, args, device, variant, inputs, trace))
                row.update(info)
                if variant in ("cp", "cp_pass"):
                    with torch.no_grad():
                        row[f"_{variant}_out"] = f(*inputs).cpu()
                if rank == 0:
                    print(f"  {variant:>7} {mode:>7} S={s:>6}: {row[variant + '_ms']:.3f} ms", flush=True)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest S: keep the other S
                # An error on one rank only leaves the others in a collective until the group's timeout.
                msg = f"{variant}/{mode} S={s}: {type(e).__name__}: {e}"[:2000]
                print(f"[rank {rank}] {msg}", flush=True)
                traceback.print_exc()
                if row is not None:
                    row["error"] = msg
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del f
        if rank == 0:  # partial results survive a later crash
            part = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results.values()]
            for r in part:
                r["single_ms"] = single.get(r["S"])
            _write(args, part, skipped, device, world_size, final=False)
    rows = []
    for (mode, s), row in sorted(results.items(), key=lambda kv: (args.modes.index(kv[0][0]), kv[0][1])):
        row["single_ms"] = single.get(s)
        a, b = row.pop("_cp_out", None), row.pop("_cp_pass_out", None)
        if a is not None and b is not None:
            row["max_abs_diff_pass_vs_nopass"] = max_over_ranks((a.float() - b.float()).abs().max().item(), device)
        else:
            max_over_ranks(0.0, device)  # keep the ranks' collectives matched
        if "error" not in row and all(row.get(k) is not None for k in ("single_ms", "copy_ms", "cp_ms", "cp_pass_ms")):
            _derive(row)
        rows.append(row)
    if rank == 0:
        _report(args, rows, skipped, device, world_size)
    dist.barrier()


def _derive(r: dict) -> None:
    r["speedup_cp"] = r["single_ms"] / r["cp_ms"]
    r["speedup_cp_pass"] = r["single_ms"] / r["cp_pass_ms"]
    for v in ("cp", "cp_pass"):
        exposed = max(0.0, r[f"{v}_ms"] - r["copy_ms"])
        r[f"exposed_{v}_ms"] = exposed
        r[f"exposed_{v}_pct"] = 100.0 * exposed / r[f"{v}_ms"]
    e0, e1 = r["exposed_cp_ms"], r["exposed_cp_pass_ms"]
    r["exposed_reduction_pct"] = 100.0 * (1 - e1 / e0) if e0 > 0 else None


def _targets(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if "exposed_cp_pass_pct" not in r:
            continue
        if r["S"] >= 8192:
            out.append({"S": r["S"], "mode": r["mode"], "target": "exposed comm <= 5% of block time (with pass)",
                        "value": round(r["exposed_cp_pass_pct"], 2), "met": r["exposed_cp_pass_pct"] <= 5.0})
        elif r["S"] == 4096:
            red = r["exposed_reduction_pct"]
            out.append({"S": r["S"], "mode": r["mode"], "target": ">= 60% less exposed comm than without the pass",
                        "value": None if red is None else round(red, 1), "met": red is None or red >= 60.0})
    return out


def _fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


HEADER = (f"{'S':>6} {'mode':>7} {'1 GPU ms':>9} {'CP ms':>8} {'CP+pass':>8} {'copy ms':>8} {'speedup':>8} "
          f"{'exposed CP':>14} {'exposed +pass':>14} {'less':>6} {'overlap CP':>10} {'+pass':>6}")


def _row_line(r: dict) -> str:
    if "error" in r or "exposed_cp_pass_ms" not in r:
        return f"{r['S']:>6} {r['mode']:>7} ERROR: {r.get('error', 'incomplete')[:200]}"
    return (f"{r['S']:>6} {r['mode']:>7} {r['single_ms']:>9.3f} {r['cp_ms']:>8.3f} {r['cp_pass_ms']:>8.3f} "
            f"{r['copy_ms']:>8.3f} {r['speedup_cp_pass']:>7.2f}x "
            f"{r['exposed_cp_ms']:>7.3f} ({r['exposed_cp_pct']:>4.1f}%) {r['exposed_cp_pass_ms']:>7.3f} "
            f"({r['exposed_cp_pass_pct']:>4.1f}%) {_fmt(r['exposed_reduction_pct'], '>5.0f')}% "
            f"{_fmt(r.get('cp_overlap_frac'), '>10.2f')} {_fmt(r.get('cp_pass_overlap_frac'), '>6.2f')}")


def _meta(args, device, world_size) -> dict:
    m = {"torch": torch.__version__, "python": platform.python_version(), "world_size": world_size,
         "device": device.type, "dtype": args.dtype, "dim": args.dim, "heads": args.heads,
         "head_dim": args.dim // args.heads, "transport": args.transport, "warmup": args.warmup,
         "repeats": args.repeats, "timing": "median of repeats per rank, max over ranks; CUDA events on GPU",
         "exposed_comm": "CP block time - same block with communication replaced by local copies of equal size",
         "overlap_frac": "from a torch.profiler trace: NCCL kernel time overlapping compute kernels / NCCL kernel time "
                         "(min over ranks)"}
    if device.type == "cuda":
        m.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                 nccl=".".join(map(str, torch.cuda.nccl.version())))
    return m


def _write(args, rows, skipped, device, world_size, final: bool) -> str:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "overlap_block.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": _meta(args, device, world_size), "rows": rows, "skipped": skipped,
                   "targets": _targets(rows) if device.type == "cuda" and final else [], "complete": final}, f, indent=1)
    os.replace(tmp, path)
    return path


def _report(args, rows, skipped, device, world_size) -> None:
    meta = _meta(args, device, world_size)
    shape = "Wan-14B-shape" if (args.dim, args.heads) == (5120, 40) else "smoke-shape"
    print(f"\noverlap_block — {shape} attention block, CP{world_size} on "
          f"{meta.get('gpu', platform.machine() + ' CPU')}, torch {meta['torch']}, {args.dtype}, dim={args.dim} "
          f"H={args.heads} D={args.dim // args.heads}, transport={args.transport}")
    print("times: median ms, max over ranks; exposed = CP − copy (% of CP block); overlap = comm time under compute")
    print(HEADER)
    print("-" * len(HEADER))
    for r in rows:
        print(_row_line(r))
    for s in skipped:
        print(f"skipped S={s['S']} {s['mode']}: {s['reason']}")
    if device.type == "cuda":
        for t in _targets(rows):
            print(f"target S={t['S']:>6} {t['mode']:>7}: {t['target']}: {t['value']} -> {'MET' if t['met'] else 'NOT MET'}")
    else:
        print("(CPU smoke run: targets are for the GPU and are not checked here)")
    path = _write(args, rows, skipped, device, world_size, final=True)
    print(f"wrote {path}")
    _plot(rows, meta, os.path.join(args.out, "overlap_block.png"))


def _plot(rows, meta, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    if not rows:
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in rows if "exposed_cp_pass_pct" in r]
    if not rows:
        return
    for i, mode in enumerate(sorted({r["mode"] for r in rows})):
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["S"])
        s, c = [r["S"] for r in rs], f"C{i}"
        a1.plot(s, [r["exposed_cp_pct"] for r in rs], "o--", color=c, label=f"{mode}, no pass")
        a1.plot(s, [r["exposed_cp_pass_pct"] for r in rs], "o-", color=c, label=f"{mode}, with pass")
        a2.plot(s, [r["speedup_cp"] for r in rs], "o--", color=c, label=f"{mode}, no pass")
        a2.plot(s, [r["speedup_cp_pass"] for r in rs], "o-", color=c, label=f"{mode}, with pass")
    a1.axhline(5, color="grey", lw=0.8, ls=":", label="5% target")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("global sequence length S (tokens)")
        a.legend(fontsize=8)
    a1.set_ylabel("exposed communication (% of block time)")
    a2.set_ylabel(f"speedup over 1 device (CP{meta['world_size']})")
    fig.suptitle(f"attention block dim={meta['dim']} H={meta['heads']} D={meta['head_dim']}, {meta['dtype']}, "
                 f"CP{meta['world_size']} on {meta.get('gpu', meta['device'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# ---- command line -------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for overlap_block.json / overlap_block.png")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="auto: cuda when a GPU is visible, else cpu (cpu = smoke run, tiny shapes)")
    p.add_argument("--nproc", type=int, default=2, help="CP world size W, ranks launched here (default 2)")
    p.add_argument("--seqs", type=int, nargs="+", default=None,
                   help="global sequence lengths S (default 4096 8192 16384 32768 GPU; 64 128 CPU)")
    p.add_argument("--modes", nargs="+", choices=["agkv", "ulysses"], default=["agkv", "ulysses"])
    p.add_argument("--transport", choices=["torch", "fast", "auto"], default="torch",
                   help="cp_ops transport of the CP variants (default torch: NCCL)")
    p.add_argument("--dim", type=int, default=None, help="model dim (default 5120 GPU, 64 CPU)")
    p.add_argument("--heads", type=int, default=None, help="heads (default 40 GPU, 4 CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 GPU, fp32 CPU")
    p.add_argument("--grid-hw", type=int, default=None, help="latent height = width for the 3-D RoPE (default 60 GPU, 4 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (incl. compile) (default 5 GPU, 1 CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls; median reported (default 20 GPU, 3 CPU)")
    p.add_argument("--profile-iters", type=int, default=3, help="calls traced by torch.profiler per CP variant")
    p.add_argument("--no-profile", action="store_true", help="skip the profiler traces (no overlap fraction)")
    p.add_argument("--keep-traces", action="store_true", help="keep the chrome traces (in --trace-dir)")
    p.add_argument("--trace-dir", default=None, help="where traces go (default a temp dir)")
    p.add_argument("--no-dynamic", dest="dynamic", action="store_false",
                   help="compile each S separately (default: S is dynamic, one compile per variant)")
    p.add_argument("--max-minutes", type=float, default=7.0,
                   help="start no new variant after this many minutes (default 7); the rest is listed as skipped")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    defaults = dict(seqs=[4096, 8192, 16384, 32768] if gpu else [64, 128], dim=5120 if gpu else 64,
                    heads=40 if gpu else 4, dtype="bf16" if gpu else "fp32", grid_hw=60 if gpu else 4,
                    warmup=5 if gpu else 1, repeats=20 if gpu else 3)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.dim % args.heads:
        raise SystemExit(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    if args.keep_traces and args.trace_dir is None:
        args.trace_dir = os.path.join(args.out, "traces")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    launch(run_rank, args.nproc, args.device, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
