"""``cp-ops bound``'s arguments: its parser and checks (torch-free until a check needs the core). The model and input
arguments are ``cp-ops run``'s (:func:`cp_ops.cli.run_args.add_model`, :func:`~cp_ops.cli.run_args.check_model`)."""

from __future__ import annotations

import os

from .. import modes
from ._args import csv, fail
from .run_args import MODEL_NAMES, add_model, check_model


def add_parser(sub) -> None:
    r = sub.add_parser("bound", help="the zero-communication bound of a diffusers DiT on ONE device: rank 0 of a fake "
                                     "W-rank group vs one device",
                       description="The model parallelized by cp_ops over a fake process group of W ranks (this "
                                   "process = rank 0 of W, collectives move nothing, their outputs written with this "
                                   "rank's own data), beside the single-device model: bound(W) = 1-device time / rank "
                                   "0's time, per compile mode. One process, one device; no torchrun. See "
                                   "docs/measuring.md.")
    r.add_argument("model", choices=list(MODEL_NAMES), help="the model family")
    r.add_argument("--worlds", dest="bound", type=csv(int, "CP world sizes"), required=True, metavar="W[,W...]",
                   help="the CP world sizes W whose rank 0 is timed (a fake group of each)")
    r.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="the one device (default: cuda when available)")
    r.add_argument("--warmup", type=int, default=None, help="untimed forwards per side (default 2 GPU, 1 CPU)")
    r.add_argument("--repeats", type=int, default=None,
                   help="interleaved rounds, each one sample of every side; the median is reported (default 5)")
    r.add_argument("--out", default=None,
                   help="write the rows and the run's metadata as JSON to this path (its missing folders are "
                        "created; an existing file is overwritten); default: no file")
    add_model(r)
    r.add_argument("--compile-modes", dest="bound_compile", type=csv(str, "compile modes"), default=None,
                   metavar="MODE[,MODE...]",
                   help="compile modes, each eager|regional|full, optionally +graphs (eager: the whole forward in "
                        "one graph; compiled: mode='reduce-overhead') or, compiled, +capture (the whole forward in "
                        "one graph) (default eager,regional,regional+graphs on CUDA, eager on CPU)")
    r.add_argument("--no-overlap", action="store_true",
                   help="compiled modes: plain torch.compile(fullgraph=True), without cp_ops' overlap pass")
    r.add_argument("--steps", type=int, default=0,
                   help="every side times whole denoising loops of N steps (ms/step, total, bound on the loop; no "
                        "final-latents error: a fake group moves nothing); default 0: one forward")
    r.add_argument("--compare", type=csv(str, "peers"), default=None, metavar="PEER[,PEER...]",
                   help="also other libraries' own context parallelism over the same fake groups, each layout's bound "
                        "beside cp_ops': diffusers (enable_parallelism, needs an accelerator), paraattn (para-attn), "
                        "xdit (xfuser/yunchang), cache-dit; a peer that refuses the model or is not installed is a "
                        "row with the reason (docs/measuring.md: peers)")
    r.add_argument("--profile", default=None, metavar="DIR",
                   help="profile one forward of every side (torch.profiler): traces and a kernel summary in DIR")
    r.add_argument("--cost", action="store_true",
                   help="also time each W with cp_ops' attention replaced by plain local attention of the same "
                        "shapes: rank 0's time minus that = cp_ops' own cost inside the bound")
    r.add_argument("--unwritten", action="store_true",
                   help="leave the fake collectives' outputs unwritten, as torch's fake backend does (kernels then "
                        "run on stale memory); default: written with this rank's data, the copies' time taken out "
                        "(docs/measuring.md)")
    r.add_argument("--no-group1", action="store_true",
                   help="skip the 'group of 1' side (cp_ops over a 1-rank group); the 1-device time is then "
                        "diffusers' alone")
    r.add_argument("--side-processes", action="store_true",
                   help="compiled modes only: every side built, compiled and timed in its own child process, all "
                        "at once, on shared weights, timed in the same interleaved rounds: one compile time for all "
                        "sides instead of one per side (docs/measuring.md)")
    r.add_argument("--compile-workers", type=int, default=0, metavar="N",
                   help="compiled modes: first compile every side in up to N child processes at once (each with "
                        "its own copy of the weights), filling torch's compile caches; default 0: off")
    r.set_defaults(nproc=1, compile=None, cuda_graphs=False, cfg=False, transport="torch", comm_dtype="none",
                   mesh=None, profile_runs=1)


def check(args, device: str) -> None:
    """Check ``cp-ops bound``'s arguments and fill in the defaults (see :mod:`cp_ops.cli.bound`); a wrong one raises
    :class:`~cp_ops.cli._args.UsageError` (via :func:`~cp_ops.cli._args.fail`)."""
    from .bound_sides import DEFAULT_CPU, DEFAULT_CUDA, parse_mode
    from .launch import under_torchrun

    what = f"bound {args.model}"
    spec, cfg = check_model(args, device, what)
    gpu = device == "cuda"
    if under_torchrun():
        fail(f"{what} runs in one process on one device (a fake group stands in for the ranks); "
             "run it without torchrun")
    if not args.bound or min(args.bound) < 1:
        fail(f"{what}: --worlds takes CP world sizes >= 1, e.g. --worlds 2,4,8; got {args.bound}")
    if args.steps < 0:
        fail(f"{what}: --steps must be >= 0; got {args.steps}")
    if args.profile and os.path.exists(args.profile) and not os.path.isdir(args.profile):
        fail(f"{what}: --profile {args.profile} is a file; give a folder for the traces")
    args.bound_compile = args.bound_compile or list(DEFAULT_CUDA if gpu else DEFAULT_CPU)
    for m in args.bound_compile:
        try:
            _, graphs = parse_mode(m)
        except ValueError as e:
            fail(f"{what}: --compile-modes: {e}")
        if graphs and not gpu:
            fail(f"{what}: --compile-modes {m} needs CUDA (CUDA graphs record GPU work); this run is on the CPU")
        if graphs and args.steps and (graphs == "forward" or m.startswith("eager")):
            fail(f"{what}: --steps with --compile-modes {m}: the explicit capture replays one forward on fixed "
                 "inputs; time a loop eager or compiled (e.g. regional+graphs: mode='reduce-overhead')")
    if args.compile_workers < 0:
        fail(f"{what}: --compile-workers takes a count of child processes >= 0; got {args.compile_workers}")
    compiled = [m for m in args.bound_compile if parse_mode(m)[0] != "eager"]
    if args.compile_workers and not compiled:
        fail(f"{what}: --compile-workers applies to compiled modes; --compile-modes is {args.bound_compile}")
    if args.side_processes:
        eager = [m for m in args.bound_compile if parse_mode(m)[0] == "eager"]
        if eager:
            fail(f"{what}: --side-processes applies when every mode is compiled (an eager side builds in seconds, "
                 f"in this process); --compile-modes has {','.join(eager)}")
        for flag, bad in (("--compile-workers", args.compile_workers), ("--profile", args.profile),
                          ("--steps", args.steps), ("--compare", args.compare)):
            if bad:
                fail(f"{what}: --side-processes does not take {flag} (--compile-workers: the sides already compile "
                     "in their own processes; --profile, --steps, --compare: not in a side's process yet); drop one")
    if args.no_overlap and not compiled:
        fail(f"{what}: --no-overlap applies to compiled modes; --compile-modes is {args.bound_compile} (add e.g. "
             "regional)")
    if args.compare:
        from .bound_peers import PEERS  # the names (each peer itself is imported when its side is built)

        bad = [p for p in args.compare if p not in PEERS]
        if bad:
            fail(f"{what}: --compare takes {','.join(PEERS)}; got {','.join(bad)}")
        args.compare = list(dict.fromkeys(args.compare))
    heads = cfg.get(spec.heads_key)
    for w in args.bound:
        if heads and args.mode != "auto" and modes.spec(args.mode).needs_heads_divisible and heads % w:
            fail(f"{what}: mode {args.mode} needs W={w} to divide the {heads} heads; use --mode agkv or --mode auto")
    args.chunks = 1 if args.chunks is None else args.chunks


#: the bound's flags, given to ``cp-ops run`` -> the ``cp-ops bound`` spelling its error names
MOVED = {"--bound": "cp-ops bound MODEL --worlds W[,W...]", "--bound-compile": "cp-ops bound MODEL --compile-modes",
         **{f: f"cp-ops bound MODEL {f}" for f in ("--cost", "--unwritten", "--no-group1", "--side-processes",
                                                   "--compile-workers")}}
