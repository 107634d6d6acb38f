"""``cp-ops`` / ``python -m cp_ops``: bench, run wan, env.

Standalone, ``bench`` and ``run`` spawn ``--nproc`` local ranks themselves; under ``torchrun`` they join
its ranks. Defaults: on a CUDA machine all visible GPUs with NCCL and the GPU shapes; otherwise (the
embedded default) 2 gloo ranks on the CPU and shapes that finish in seconds.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

GPU_SEQS = [4096, 8192, 16384, 32768, 75600]
CPU_SEQS = [512, 1024, 2048]


def _csv(kind):
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}: {e}") from e

    return parse


def _device(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cp-ops: --device cuda but torch.cuda.is_available() is False; use --device cpu")
    return args.device


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="CP world size W: local ranks to spawn (default: all visible GPUs on CUDA, 2 on CPU; "
                        "ignored under torchrun)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cuda = NCCL, one GPU per rank; cpu = gloo (default: cuda when available)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs before timing (default 5 GPU, 1 CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs; the median is reported (default 20 GPU, 3 CPU)")
    p.add_argument("--out", default=None, help="JSON results path (default cp_ops_results/<command>.json; '' = none)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="cp-ops",
        description="Context-parallel attention for diffusion transformers: benchmark, run a real Wan "
                    "transformer under CP, inspect the environment.",
        epilog="examples:  cp-ops bench   |   cp-ops bench --seqs 4096,8192 --modes agkv   |   "
               "cp-ops run wan --config 1.3b --frames 16 --height 64 --width 64   |   cp-ops env   |   "
               "torchrun --nproc-per-node 2 -m cp_ops bench",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bench", help="CP attention microbenchmark: time, speedup over one device, error",
                       description="Dense non-causal attention, BSHD, global S split evenly over W ranks. For each "
                                   "S, mode and transport: CP time (median, max over ranks), single-device SDPA "
                                   "time, speedup and relative error against the single-device output.")
    _common(b)
    b.add_argument("--seqs", type=_csv(int), default=None,
                   help=f"global sequence lengths S, comma-separated (default GPU {GPU_SEQS}, CPU {CPU_SEQS})")
    b.add_argument("--modes", type=_csv(str), default=["agkv", "ulysses"], help="agkv,ulysses (default both)")
    b.add_argument("--transports", type=_csv(str), default=None,
                   help="torch,fast,auto (default: torch, plus fast where it can run)")
    b.add_argument("--batch", type=int, default=1, help="batch B (default 1)")
    b.add_argument("--heads", type=int, default=None, help="heads H (default 40 GPU, 8 CPU)")
    b.add_argument("--head-dim", type=int, default=None, help="head dim D (default 128 GPU, 64 CPU)")
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 GPU, fp32 CPU")
    b.add_argument("--plot", default=None, help="write a PNG of speedup vs S to this path (needs matplotlib)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")

    r = sub.add_parser("run", help="run a real diffusers DiT forward, single rank vs CP")
    r.add_argument("model", choices=["wan"], help="the model family (Wan 2.1 transformer)")
    _common(r)
    r.add_argument("--config", choices=["1.3b", "14b", "tiny"], default=None,
                   help="Wan2.1-T2V-1.3B (30 layers, dim 1536, 12 heads), 14B (40 layers, dim 5120, 40 heads) "
                        "or tiny (default 1.3b on GPU, tiny on CPU)")
    r.add_argument("--layers", type=int, default=None, help="cut depth to N transformer blocks")
    r.add_argument("--frames", type=int, default=None, help="latent frames (default 16 GPU, 2 CPU)")
    r.add_argument("--height", type=int, default=None, help="latent height (default 64 GPU, 16 CPU)")
    r.add_argument("--width", type=int, default=None, help="latent width (default 64 GPU, 16 CPU)")
    r.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 GPU, fp32 CPU")
    r.add_argument("--mode", choices=["auto", "agkv", "ulysses"], default="auto")
    r.add_argument("--transport", choices=["auto", "torch", "fast"], default="auto")
    r.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) both runs")

    sub.add_parser("env", help="devices, P2P matrix, backends, which transports would run and why not")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "env":
        from .env_report import print_env

        print_env()
        return 0
    from .launch import launch, under_torchrun

    device = _device(args)
    gpu = device == "cuda"
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if gpu else 2
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    args.repeats = args.repeats if args.repeats is not None else (20 if gpu else 3)
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit(f"cp-ops: --repeats must be >= 1 and --warmup >= 0; got {args.repeats}, {args.warmup}")
    if args.dtype is None:
        args.dtype = "bf16" if gpu else "fp32"
    if args.out is None:
        args.out = f"cp_ops_results/{'bench' if args.cmd == 'bench' else 'run_' + args.model}.json"
    if args.cmd == "bench":
        from .bench import run_bench
        from .transport.fast import unavailable_reason

        args.seqs = args.seqs or (GPU_SEQS if gpu else CPU_SEQS)
        args.heads = args.heads or (40 if gpu else 8)
        args.head_dim = args.head_dim or (128 if gpu else 64)
        bad = [m for m in args.modes if m not in ("agkv", "ulysses", "auto")]
        if bad:
            raise SystemExit(f"cp-ops bench: --modes takes agkv,ulysses,auto; got {bad}")
        if args.transports is None:
            args.transports = ["torch"] + (["fast"] if unavailable_reason(device) is None else [])
        bad = [t for t in args.transports if t not in ("torch", "fast", "auto")]
        if bad:
            raise SystemExit(f"cp-ops bench: --transports takes torch,fast,auto; got {bad}")
        if "fast" in args.transports and (why := unavailable_reason(device)) is not None:
            raise SystemExit(f"cp-ops bench: transport 'fast' cannot run: {why}")
        if "fast" in args.transports and "CP_OPS_FAST_POOL_GB" not in os.environ:
            from .bench import DTYPES, fast_pool_gib

            world = int(os.environ.get("WORLD_SIZE", args.nproc))
            need = fast_pool_gib(args.seqs, args.batch, args.heads, args.head_dim, DTYPES[args.dtype], world)
            if need > 7:  # the pool's default is 8 GiB; leave room for its control block
                os.environ["CP_OPS_FAST_POOL_GB"] = str(math.ceil(need * 1.1))
                print(f"cp-ops bench: these shapes fill {need:.1f} GiB of the fast transport's symmetric pool; "
                      f"using CP_OPS_FAST_POOL_GB={os.environ['CP_OPS_FAST_POOL_GB']} (set it to override)")
        launch(run_bench, args.nproc, device, args)
    elif args.cmd == "run":
        from .run_wan import run_wan

        args.config = args.config or ("1.3b" if gpu else "tiny")
        args.frames = args.frames or (16 if gpu else 2)
        args.height = args.height or (64 if gpu else 16)
        args.width = args.width or (64 if gpu else 16)
        launch(run_wan, args.nproc, device, args)
    if not under_torchrun():
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
