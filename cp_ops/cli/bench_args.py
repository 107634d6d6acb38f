"""``cp-ops bench``'s arguments: its parser and checks (torch-free until a check needs the core)."""

from __future__ import annotations

import importlib.util
import math

from .. import modes
from ._args import add_mesh, check_comm_dtype, check_mesh, chunks, common, csv, fail, rank0

GPU_SEQS = [4096, 8192, 16384, 32768, 75600]
CPU_SEQS = [512, 1024, 2048]


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="CP attention microbenchmark: time, speedup over one device, bound, error",
                       description="Dense non-causal attention, BSHD, global S split evenly over W ranks. For each "
                                   "S, mode, chunk count and transport: CP time in steady state (calls back to back, "
                                   "median, max over ranks) and per-call latency, single-device SDPA time on rank 0 "
                                   "(per S, --repeats rounds: each times the single-device baseline, then one sample "
                                   "of every case), speedup, the bound and % of it reached, relative error.")
    common(b, "interleaved rounds per S, each one steady-state sample (--calls calls back to back) of the "
               "single-device baseline and of every case; and, separately, as many single waited-for calls "
               "(latency); medians and p25-p75 are reported (default 5)")
    b.add_argument("--seqs", type=csv(int), default=None,
                   help=f"global sequence lengths S, comma-separated (default GPU {GPU_SEQS}, CPU {CPU_SEQS})")
    b.add_argument("--modes", type=csv(str), default=None,
                   help=f"{','.join(modes.names())} (default {','.join(modes.names(False))}; a mode that splits "
                        "heads, e.g. ulysses, is skipped where W does not divide H); with --mesh: "
                        f"{','.join(modes.names(dims=2))} (default {','.join(modes.names(False, dims=2))})")
    b.add_argument("--transports", type=csv(str), default=None,
                   help="torch,fast,auto (default: torch, plus fast where it can run)")
    b.add_argument("--chunks", type=csv(chunks, "chunk counts (ints >= 1 or auto)"), default=[1],
                   help="pipeline stages per named mode, comma-separated: 1 (transport-then-attend), k >= 2 "
                        "(pipelined), auto (chunks=None: the heuristic; measured with CP_OPS_TUNE_MODES=1) (default 1); --modes auto always "
                        "runs mode='auto', chunks=None and reports the variant it picked")
    b.add_argument("--calls", type=int, default=None,
                   help="calls back to back per steady-state sample (default 10 GPU; 1 CPU, where gloo calls run "
                        "one after another anyway)")
    b.add_argument("--comm-dtype", default="none", metavar="{none,e4m3,e5m2,e4m3:qvo,...}",
                   help="what the CP attention sends (cp_ops.attention(comm_dtype=)): none (default) = the input "
                        "dtype; e4m3/e5m2 = FP8; FMT:LETTERS = only those of q,k,v,o (docs/fp8.md)")
    b.add_argument("--batch", type=int, default=1, help="batch B (default 1)")
    b.add_argument("--heads", type=int, default=None, help="heads H (default 40 GPU, 8 CPU)")
    b.add_argument("--head-dim", type=int, default=None, help="head dim D (default 128 GPU, 64 CPU)")
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 GPU, fp32 CPU")
    b.add_argument("--plot", default=None, help="write a PNG of speedup vs S to this path (needs matplotlib)")
    b.add_argument("--graphs", action="store_true",
                   help="CUDA only: also time each case (and the 1-device baseline) replayed from a CUDA graph: the "
                        "speedup without the host's launch cost. Captured fast-transport calls keep their symmetric "
                        "buffers until exit, so keep --seqs small (e.g. 4096,8192)")
    add_mesh(b, "; rows gain ulysses_comm_ms and agkv_comm_ms")
    prog = b.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="show the progress bar even when stderr is not a terminal")
    prog.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bar (default: shown only when stderr is a terminal)")


def check(args, device: str, world: int, settings) -> None:
    """Check ``cp-ops bench``'s arguments and fill in the device defaults (S, heads, transports, calls; the fast
    pool size when the shapes need more); a wrong one raises :class:`~cp_ops.cli._args.UsageError`."""
    from cp_ops.transport.fast import unavailable_reason

    gpu = device == "cuda"
    seqs_given = args.seqs is not None
    args.seqs = (GPU_SEQS if gpu else CPU_SEQS) if args.seqs is None else args.seqs
    args.heads = (40 if gpu else 8) if args.heads is None else args.heads
    args.head_dim = (128 if gpu else 64) if args.head_dim is None else args.head_dim
    if min(args.heads, args.head_dim, args.batch) < 1:
        fail(f"bench: --heads, --head-dim and --batch must be >= 1; got {args.heads}, {args.head_dim}, {args.batch}")
    check_comm_dtype(args, "bench")
    mesh = getattr(args, "mesh", None) is not None
    check_mesh(args, "bench", world, args.heads)
    dims = 2 if mesh else 1
    if args.modes is None:
        args.modes = list(modes.names(False, dims=dims))
    bad = [m for m in args.modes if m not in modes.names(dims=dims)]
    if bad:
        hint = (" (the 2-D mode runs with --mesh OxI)" if not mesh and any(m in modes.names(dims=2) for m in bad) else
                " (--mesh runs the 2-D mode: a 1-D mode runs without --mesh)" if mesh else "")
        takes = ",".join(modes.names(dims=dims)) + (" with --mesh" if mesh else "")
        fail(f"bench: --modes takes {takes}; got {bad}{hint}")
    if args.transports is None:
        args.transports = ["torch"] + (["fast"] if unavailable_reason(device) is None else [])
    bad = [t for t in args.transports if t not in ("torch", "fast", "auto")]
    if bad:
        fail(f"bench: --transports takes torch,fast,auto; got {bad}")
    if "fast" in args.transports and (why := unavailable_reason(device)) is not None:
        fail(f"bench: transport 'fast' cannot run: {why}")
    bad = [s for s in args.seqs if s < world or s % world]
    if bad and not seqs_given:  # e.g. --nproc 3 with the default S: say so, and offer multiples of W
        near = ",".join(str(max(world, s - s % world)) for s in args.seqs)
        fail(f"bench: the default S {args.seqs} are not all multiples of the CP world size {world}; give --seqs, "
              f"e.g. --seqs {near}")
    if bad:
        fail(f"bench: every S in --seqs must be a positive multiple of the CP world size {world}; got {bad}")
    if not mesh and args.heads % world and all(m != "auto" and modes.spec(m).needs_heads_divisible
                                               for m in args.modes):
        fail(f"bench: mode {','.join(args.modes)} needs the CP world size {world} to divide --heads {args.heads}; "
              "pick other heads or add --modes agkv")
    args.calls = (10 if gpu else 1) if getattr(args, "calls", None) is None else args.calls
    args.chunks = getattr(args, "chunks", [1])
    if args.calls < 1:
        fail(f"bench: --calls must be >= 1; got {args.calls}")
    if getattr(args, "graphs", False) and not gpu:
        fail(f"bench: --graphs needs CUDA GPUs (it captures CUDA graphs); this run is on {device}: drop --graphs")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        fail("bench: --plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')")
    if "fast" in args.transports and settings.sources.get("fast_pool_gb") == "default":
        from .bench import DTYPES, fast_pool_gib

        need = fast_pool_gib(args.seqs, args.batch, args.heads, args.head_dim, DTYPES[args.dtype], world,
                             tuple(args.chunks) + ((None,) if "auto" in args.modes else ()))
        if need > settings.fast_pool_gb - 1:  # leave room for the pool's control block
            args.settings["fast_pool_gb"] = math.ceil(need * 1.1)
            if rank0():
                print(f"cp-ops bench: these shapes fill {need:.1f} GiB of the fast transport's symmetric pool; "
                      f"using fast_pool_gb={args.settings['fast_pool_gb']} (set CP_OPS_FAST_POOL_GB to override)")

