"""``cp-ops`` / ``python -m cp_ops``: bench, run MODEL, bound MODEL, plan MODEL, generate, env.

``bench``, ``run`` and ``generate`` spawn ``--nproc`` local ranks (default: every visible GPU, else 2 gloo ranks) or
join torchrun's; ``bound`` runs in this process on one device; ``plan`` and ``env`` run nothing on a device. Parsers and
checks are torch-free ``<command>_args`` modules; a wrong argument or ``CP_OPS_*`` value prints one line ``cp-ops: ...``
(rank 0) and exits 2. Settings reach the ranks through :func:`cp_ops.config.configure` (never the environment).
"""

from __future__ import annotations

import argparse
import os
import sys

from . import bench_args, bound_args, generate_args, plan_args, run_args
from ._args import RENAMED, Parser, UsageError, check_out, fail, say_once


def _device(args) -> str:
    """``--device``: 'cuda' or 'cpu' (``shared``: 'cuda', its ranks all on cuda:0)."""
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "shared" and not torch.cuda.is_available():
        fail("--device shared puts every rank on cuda:0: it needs a CUDA GPU; torch.cuda.is_available() is False "
             "(use --device cpu)")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    return "cuda" if args.device == "shared" else args.device


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="cp-ops",
        description="Context-parallel attention for diffusion transformers: benchmark, run a diffusers DiT "
                    "(Wan, Z-Image, Flux, Qwen-Image, HunyuanVideo, LTX-Video) under CP, bound it on one device, "
                    "plan its layout on N GPUs, generate with a local pipeline, inspect the environment.",
        epilog="examples:  cp-ops bench   |   cp-ops bench --seqs 4096,8192 --modes agkv   |   "
               "cp-ops run wan --config 1.3b --frames 16 --height 64 --width 64   |   cp-ops run flux --steps 4   |   "
               "cp-ops bound flux --worlds 2,4,8   |   cp-ops plan wan --gpus 8   |   "
               "cp-ops generate --checkpoint DIR --prompt '...'   |   cp-ops env   |   "
               "torchrun --nproc-per-node 2 -m cp_ops bench",
    )
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    bench_args.add_parser(sub)
    run_args.add_parser(sub)
    bound_args.add_parser(sub)
    plan_args.add_parser(sub)
    generate_args.add_parser(sub)
    sub.add_parser("env", help="devices, P2P matrix, backends, which transports would run and why not",
                   description="Print cp_ops' settings (CP_OPS_*), the devices and their P2P access matrix, the "
                               "torch.distributed backends, and which transports would run here (or why not). Takes "
                               "no options; runs on CPU-only machines too.")
    return ap


def load_settings():
    """``cp_ops.config.settings``; a bad ``CP_OPS_*`` value becomes a :class:`UsageError` (its one line)."""
    try:
        from cp_ops import config
    except ValueError as e:  # cp_ops.config.ConfigError: parsed once at import
        if type(e).__name__ != "ConfigError":
            raise
        fail(str(e))
    return config.settings


def _rank_entry(rank: int, world_size: int, device, fn, args) -> None:
    """What every rank runs: apply the CLI's settings with :func:`cp_ops.config.configure`, then ``fn``."""
    from cp_ops import config

    if args.settings:
        config.configure(**args.settings)
    fn(rank, world_size, device, args)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an argument the command does not take is reported by that command's parser (its usage,
    not the top-level one), naming the commands that do take such a flag (``cp-ops run wan --plot x`` →
    ``--plot is an option of cp-ops bench``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        hints = []
        for flag in dict.fromkeys(f.split("=")[0] for f in extra if f.startswith("--")):
            if args.cmd == "run" and flag in bound_args.MOVED:
                sub["run"].error(f"{flag}: the bound is its own command now: {bound_args.MOVED[flag]} "
                                 "(cp-ops bound --help)")
            if args.cmd in ("bench", "run") and flag in RENAMED:
                sub[args.cmd].error(f"{flag} is {RENAMED[flag]} now (every rank on cuda:0)")
            if args.cmd == "run" and flag in plan_args.MOVED:
                sub["run"].error(f"{flag}: the plan is its own command now: "
                                 f"{plan_args.MOVED[flag].replace('MODEL', args.model)} (cp-ops plan --help)")
            owners = [f"cp-ops {n}" for n, p in sub.items() if n != args.cmd and flag in p._option_string_actions]
            if owners:
                hints.append(f"{flag} is an option of {', '.join(owners)}")
        hint = f" ({'; '.join(hints)})" if hints else ""
        sub[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def main(argv: list[str] | None = None) -> int:
    """The ``cp-ops`` command. Returns the exit code: 0, or 2 for a wrong argument or setting."""
    args = _parse(argv)
    try:
        return _main(args)
    except UsageError as e:
        say_once(f"cp-ops: {e}")
        return 2


def _main(args) -> int:
    if args.cmd == "env":
        from .env_report import print_env

        return print_env()
    settings = load_settings()
    if args.cmd == "plan":  # nothing runs: the planned layout for N GPUs
        from .plan import print_plan

        return print_plan(args)
    import torch
    import torch.multiprocessing as mp

    from .launch import SHARED, launch, under_torchrun

    shared = args.device == "shared"  # bench and run (common): every rank on cuda:0
    device = _device(args)
    gpu = device == "cuda"
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if gpu else 2
    if args.nproc < 1:
        fail(f"--nproc must be >= 1; got {args.nproc}")
    if shared and under_torchrun():
        fail("--device shared spawns its own ranks; under torchrun give each rank its own GPU (use --device cuda)")
    if gpu and not shared and not under_torchrun() and torch.cuda.device_count() < args.nproc:
        fail(f"--nproc {args.nproc} needs {args.nproc} visible GPUs; found {torch.cuda.device_count()} "
              "(lower --nproc or use --device cpu)")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    if args.dtype is None:
        args.dtype = "bf16" if gpu else "fp32"
    args.settings = {}
    if args.cmd == "generate":
        from .generate import generate as body

        generate_args.check(args, device, world)
        check_out(args.out, "--out")
        launch(_rank_entry, args.nproc, SHARED if shared else device, body, args)
        return 0
    bound = args.cmd == "bound"
    args.warmup = args.warmup if args.warmup is not None else (2 if bound else 5) if gpu else (1 if bound else 2)
    args.repeats = args.repeats if args.repeats is not None else (
        5 if args.cmd == "bench" or bound else 20 if gpu else 10)
    if args.repeats < 1 or args.warmup < 0:
        fail(f"--repeats must be >= 1 and --warmup >= 0; got {args.repeats}, {args.warmup}")
    if args.cmd == "bench":
        from .bench import run_bench as body

        bench_args.check(args, device, world, settings)
        check_out(args.plot, "--plot")
    elif bound:
        bound_args.check(args, device)
    else:
        from .run import run_model as body

        run_args.check(args, device, world)
    check_out(args.out, "--out")
    if bound:  # one process, this device: no ranks to launch (no check sets args.settings for it)
        from .bound import run_bound

        run_bound(args, torch.device(device, 0) if gpu else torch.device("cpu"))
        return 0
    if shared:
        print(f"cp-ops {args.cmd}: --device shared: {args.nproc} ranks share cuda:0 over gloo; the outputs are checked "
              "as on separate GPUs, the times are not speed numbers", flush=True)
    try:
        launch(_rank_entry, args.nproc, SHARED if shared else device, body, args)
    except mp.ProcessExitedException as e:  # a rank's sys.exit(code): e.g. run's UNSUPPORTED (its line is printed)
        return e.exit_code or 1
    if not under_torchrun():
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
