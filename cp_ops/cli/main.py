"""``cp-ops`` / ``python -m cp_ops``: bench, run MODEL, generate, env.

Standalone, ``bench`` and ``run`` spawn ``--nproc`` local ranks themselves; under ``torchrun`` they join
its ranks. Defaults: on a CUDA machine all visible GPUs with NCCL and the GPU shapes; otherwise (the
embedded default) 2 gloo ranks on the CPU and shapes that finish in seconds.

Arguments are parsed and checked before torch is imported (``--help`` and a wrong flag answer at once). A
wrong argument or a bad ``CP_OPS_*`` value prints one line ``cp-ops: ...`` and exits 2; under torchrun only
rank 0 prints it. Settings reach the ranks through :func:`cp_ops.config.configure` (never the environment).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
import time

from .. import modes

#: ``cp-ops run`` model names (cp_ops.cli.models.MODELS, listed here so --help needs no torch import)
MODEL_NAMES = ("wan", "zimage", "flux", "qwenimage", "hunyuanvideo")
GPU_SEQS = [4096, 8192, 16384, 32768, 75600]
CPU_SEQS = [512, 1024, 2048]


def _csv(kind, what: str | None = None):
    def parse(text):
        try:
            return [kind(x) for x in text.split(",") if x]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what or kind.__name__}: {e}") from e

    return parse


def _chunks(text: str):
    """A ``--chunks`` item: an int >= 1, or 'auto' (None: the measured choice)."""
    if text.strip().lower() in ("auto", "none"):
        return None
    v = int(text)
    if v < 1:
        raise ValueError(f"chunks must be >= 1 or auto; got {v}")
    return v


def _chunks_arg(text: str):
    """``cp-ops run --chunks``: 'auto' (None) or an int >= 1; argparse's error otherwise."""
    try:
        return _chunks(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected auto or an int >= 1; got {text!r}") from e


class UsageError(Exception):
    """A wrong argument or setting: main() prints ``cp-ops: <message>`` once (rank 0) and returns 2."""


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _say_once(line: str) -> None:
    """Print one error line to stderr from rank 0 only; other torchrun ranks stay silent and let rank 0 exit
    first (so torchrun's summary names rank 0's exit code 2 as the root cause)."""
    if _rank0():
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(1.0)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors (unknown flag, bad choice): once, exit 2
        if _rank0():
            self.print_usage(sys.stderr)
        _say_once(f"{self.prog}: error: {message}")
        sys.exit(2)


def _device(args) -> str:
    import torch

    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        _fail("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    return args.device


def _common(p: argparse.ArgumentParser, repeats_help: str) -> None:
    p.add_argument("--nproc", type=int, default=None,
                   help="CP world size W: local ranks to spawn (default: all visible GPUs on CUDA, 2 on CPU); "
                        "under torchrun, W is torchrun's --nproc-per-node")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="cuda = NCCL, one GPU per rank; cpu = gloo (default: cuda when available)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs before timing (default 5 GPU, 2 CPU)")
    p.add_argument("--repeats", type=int, default=None, help=repeats_help)
    p.add_argument("--out", default=None,
                   help="write the results as JSON to this path (checked for writability before the run; an existing "
                        "file is overwritten and the output says so); default: no file")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="cp-ops",
        description="Context-parallel attention for diffusion transformers: benchmark, run a diffusers DiT "
                    "(Wan, Z-Image, Flux, Qwen-Image, HunyuanVideo) under CP, generate with a local pipeline, "
                    "inspect the environment.",
        epilog="examples:  cp-ops bench   |   cp-ops bench --seqs 4096,8192 --modes agkv   |   "
               "cp-ops run wan --config 1.3b --frames 16 --height 64 --width 64   |   cp-ops run flux --steps 4   |   "
               "cp-ops generate --checkpoint DIR --prompt '...'   |   cp-ops env   |   "
               "torchrun --nproc-per-node 2 -m cp_ops bench",
    )
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    b = sub.add_parser("bench", help="CP attention microbenchmark: time, speedup over one device, bound, error",
                       description="Dense non-causal attention, BSHD, global S split evenly over W ranks. For each "
                                   "S, mode, chunk count and transport: CP time in steady state (calls back to back, "
                                   "median, max over ranks) and per-call latency, single-device SDPA time measured "
                                   "the same way on rank 0 alone (per S, --repeats rounds: each times the "
                                   "single-device baseline, then one sample of every case), speedup, the bound "
                                   "(max of attention at one rank's share and the bytes to receive over the "
                                   "measured P2P bandwidth) and % of it reached, and "
                                   "relative error against the single-device output.")
    _common(b, "interleaved rounds per S, each one steady-state sample (--calls calls back to back) of the "
               "single-device baseline and of every case; and, separately, as many single waited-for calls "
               "(latency); medians and p25-p75 are reported (default 5)")
    b.add_argument("--seqs", type=_csv(int), default=None,
                   help=f"global sequence lengths S, comma-separated (default GPU {GPU_SEQS}, CPU {CPU_SEQS})")
    b.add_argument("--modes", type=_csv(str), default=list(modes.names(False)),
                   help=f"{','.join(modes.names())} (default {','.join(modes.names(False))}; a mode that splits "
                        "heads, e.g. ulysses, is skipped where W does not divide H)")
    b.add_argument("--transports", type=_csv(str), default=None,
                   help="torch,fast,auto (default: torch, plus fast where it can run)")
    b.add_argument("--chunks", type=_csv(_chunks, "chunk counts (ints >= 1 or auto)"), default=[1],
                   help="pipeline stages per named mode, comma-separated: 1 (transport-then-attend), k >= 2 "
                        "(pipelined), auto (chunks=None: the measured choice) (default 1); --modes auto always "
                        "runs mode='auto', chunks=None and reports the variant it picked")
    b.add_argument("--calls", type=int, default=None,
                   help="calls back to back per steady-state sample (default 10 GPU; 1 CPU, where gloo calls run "
                        "one after another anyway)")
    b.add_argument("--batch", type=int, default=1, help="batch B (default 1)")
    b.add_argument("--heads", type=int, default=None, help="heads H (default 40 GPU, 8 CPU)")
    b.add_argument("--head-dim", type=int, default=None, help="head dim D (default 128 GPU, 64 CPU)")
    b.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 GPU, fp32 CPU")
    b.add_argument("--plot", default=None, help="write a PNG of speedup vs S to this path (needs matplotlib)")
    b.add_argument("--graphs", action="store_true",
                   help="CUDA only: also time each case replayed from a CUDA graph (one call captured, replays back "
                        "to back), the 1-device baseline captured the same way: the GPU-bound speedup, without "
                        "the host's launch cost (what torch.compile(mode='reduce-overhead') or explicit capture "
                        "gets). Captured fast-transport calls keep their symmetric buffers until exit, so keep "
                        "--seqs small (e.g. 4096,8192)")
    prog = b.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="show the progress bar even when stderr is not a terminal")
    prog.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bar (default: shown only when stderr is a terminal)")

    r = sub.add_parser("run", help="a diffusers DiT (Wan, Z-Image, Flux, Qwen-Image, HunyuanVideo; random weights or "
                                   "--checkpoint): one forward or --steps N, single rank vs CP",
                       description="The model's released config with random seeded weights (or a local checkpoint's "
                                   "transformer), the same inputs on every rank: the single-rank model on rank 0, "
                                   "then (--compare diffusers) diffusers' own CP, then cp_ops.parallelize; time (one "
                                   "forward per row: re-timed at the end in --repeats interleaved rounds, every side "
                                   "once per round), speedup, max relative error. Sizes are latent (VAE space, "
                                   "pixels / 8).")
    r.add_argument("model", choices=list(MODEL_NAMES), help="the model family")
    _common(r, "timed forwards per side, and the interleaved rounds that give the final times (without --steps "
               "and --cuda-graphs); the median is reported (default 20 GPU, 10 CPU; with --steps N: unused, one "
               "timed loop, its median step)")
    r.add_argument("--config", default=None,
                   help="released config: wan 1.3b|14b, zimage turbo, flux dev|schnell, qwenimage 20b, "
                        "hunyuanvideo 13b; tiny for any (default: the first on GPU, tiny on CPU)")
    r.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="load the transformer of this local diffusers checkpoint (pipeline folder or its "
                        "transformer/ folder) instead of random weights")
    r.add_argument("--layers", type=int, default=None,
                   help="cut depth to N blocks of each kind (Flux, HunyuanVideo: N double- and N single-stream)")
    r.add_argument("--frames", type=int, default=None, help="latent frames (video models; default on GPU the model's standard length: wan 21 (81 "
                        "frames), hunyuanvideo 16 (61 frames); 2 CPU; image models 1)")
    r.add_argument("--height", type=int, default=None, help="latent height (pixels / 8; default on GPU the model's standard resolution: wan 60x104 "
                        "(480p), hunyuanvideo 68x120 (544x960), flux/zimage 128 (1024²), qwenimage 166 (1328²); 16 CPU)")
    r.add_argument("--width", type=int, default=None,
                   help="latent width (pixels / 8; default: as --height when --height is given, else the model's)")
    r.add_argument("--text-tokens", type=int, default=None, help="text sequence length (default: the model's, see models.py)")
    r.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 GPU, fp32 CPU")
    r.add_argument("--mode", choices=modes.names(), default="auto",
                   help="CP attention mode: agkv (gather K/V, keep local Q), ulysses (all-to-all sequence<->heads; "
                        "W must divide the heads), auto (agkv at W = 2; from W = 3 ulysses when W divides the heads, else agkv)")
    r.add_argument("--transport", choices=["auto", "torch", "fast"], default="auto",
                   help="torch (torch.distributed: NCCL/gloo), fast (NVSHMEM/P2P, one Hopper node), "
                        "auto (fast where it can run, else torch; `cp-ops env` says which)")
    r.add_argument("--chunks", type=_chunks_arg, default=None, metavar="{auto,1,2,3,4,...}",
                   help="pipeline stages of every CP attention call (parallelize(..., chunks=)): 1 = "
                        "transport-then-attend (bitwise equal to one GPU); k >= 2 = pipelined in k stages "
                        "(communication under attention); auto (default) = measured on the first eager call, the "
                        "heuristic under --compile (2 for agkv on the fast transport, else 1). Calls on uneven "
                        "shards or with a key mask use 1")
    r.add_argument("--compile", nargs="?", const="regional", choices=["regional", "full"], default=None,
                   help="compile every side with cp_ops.compile (torch.compile(fullgraph=True) + the K/V overlap "
                        "pass): regional (default) = each repeated block, as diffusers' compile_repeated_blocks "
                        "(seconds); full = the whole model. The first call's time (compile included) is reported")
    r.add_argument("--no-overlap", action="store_true",
                   help="with --compile: plain torch.compile(fullgraph=True), without the overlap pass")
    r.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA-graph replay (CUDA only): with --compile, mode='reduce-overhead'; without, explicit "
                        "torch.cuda.graph capture of the forward")
    r.add_argument("--steps", type=int, default=0,
                   help="a denoising loop of N steps (the model's diffusers scheduler, the transformer called N "
                        "times): time per step and total (default 0: one forward)")
    r.add_argument("--cfg", action="store_true",
                   help="CFG-parallel layout: conditional and unconditional batch halves on two halves of the "
                        "ranks, CP inside each (parallelize(..., cfg_parallel=True); W even)")
    r.add_argument("--compare", choices=["diffusers"], default=None,
                   help="also run diffusers' native context parallelism (enable_parallelism, Ulysses and ring) "
                        "on the same model and inputs; rows beside cp_ops'")
    r.add_argument("--profile", default=None, metavar="DIR",
                   help="profile the CP run (torch.profiler): Chrome traces DIR/trace_rank*.json.gz and a per-layer "
                        "breakdown (GPU busy/idle, attention, exposed communication, replicated work, gather, host syncs)")
    r.add_argument("--profile-runs", type=int, default=3, help="forwards in the --profile trace (default 3)")
    r.add_argument("--bound", type=_csv(int, "CP world sizes"), default=None, metavar="W[,W...]",
                   help="the zero-communication bound on ONE device instead of a CP run: the model parallelized over a "
                        "fake process group of W ranks (this process = rank 0 of W, collectives move nothing); "
                        "bound(W) = 1-device time / rank 0's time, per compile mode (--bound-compile); see "
                        "docs/measuring.md")
    r.add_argument("--bound-compile", type=_csv(str, "compile modes"), default=None, metavar="MODE[,MODE...]",
                   help="with --bound: compile modes, each eager|regional|full, optionally +graphs (CUDA graphs) "
                        "(default eager,regional,regional+graphs on CUDA, eager on CPU)")
    r.add_argument("--cost", action="store_true",
                   help="with --bound: also time each W with cp_ops' attention replaced by plain local attention of "
                        "the same shapes: rank 0's time minus that = cp_ops' own cost inside the bound")
    r.add_argument("--random-memory", action="store_true",
                   help="with --bound (experimental, CUDA): fill the GPU's free memory with random values first, so "
                        "buffers a fake collective never writes hold random values rather than zeros (zeros make "
                        "rank 0's kernels faster than real data: docs/measuring.md)")
    r.add_argument("--no-group1", action="store_true",
                   help="with --bound: skip the 'group of 1' side (cp_ops over a 1-rank group); the 1-device time is "
                        "then diffusers' alone")

    gen = sub.add_parser("generate", help="a whole local diffusers pipeline, its transformer under CP: writes the "
                                          "image (PNG) or video (MP4, or a PNG grid of frames)",
                         description="DiffusionPipeline.from_pretrained(--checkpoint), its transformer parallelized "
                                     "with cp_ops; every rank runs the same sampling loop (same seed), rank 0 "
                                     "writes the result and shows the pipeline's progress bar.")
    gen.add_argument("--checkpoint", required=True, metavar="DIR", help="a local diffusers pipeline folder")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", default=None, help="the text prompt")
    src.add_argument("--prompt-embeds", default=None, metavar="FILE",
                     help="a torch.save'd prompt-embedding tensor [B, L, dim] instead of --prompt (pipelines "
                          "saved without a text encoder/tokenizer)")
    gen.add_argument("--steps", type=int, default=None, help="sampling steps (default 30 GPU, 2 CPU)")
    gen.add_argument("--height", type=int, default=None, help="pixel height (default: the pipeline's)")
    gen.add_argument("--width", type=int, default=None, help="pixel width (default: the pipeline's)")
    gen.add_argument("--frames", type=int, default=None, help="video frames (video pipelines; default: the pipeline's)")
    gen.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the pipeline's)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0; the same on every rank)")
    gen.add_argument("--out", default=None,
                     help="output file (default out.png, or out.mp4 for a video pipeline; .png for a video = a grid)")
    gen.add_argument("--nproc", type=int, default=None, help="CP world size W (default: all GPUs, 2 on CPU)")
    gen.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                     help="cuda = NCCL, one GPU per rank; cpu = gloo (default: cuda when available)")
    gen.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 GPU, fp32 CPU")
    gen.add_argument("--mode", choices=modes.names(), default="auto", help="CP attention mode (as in run)")
    gen.add_argument("--transport", choices=["auto", "torch", "fast"], default="auto", help="as in run")

    sub.add_parser("env", help="devices, P2P matrix, backends, which transports would run and why not")
    return ap


def _fail(msg: str) -> None:
    raise UsageError(msg)


def _check_bench(args, device: str, world: int, settings) -> None:
    from cp_ops.transport.fast import unavailable_reason

    gpu = device == "cuda"
    seqs_given = args.seqs is not None
    args.seqs = (GPU_SEQS if gpu else CPU_SEQS) if args.seqs is None else args.seqs
    args.heads = (40 if gpu else 8) if args.heads is None else args.heads
    args.head_dim = (128 if gpu else 64) if args.head_dim is None else args.head_dim
    if not args.seqs:
        _fail("bench: --seqs is empty; give comma-separated sequence lengths, e.g. --seqs 4096,8192")
    if min(args.heads, args.head_dim, args.batch) < 1:
        _fail(f"bench: --heads, --head-dim and --batch must be >= 1; got {args.heads}, {args.head_dim}, {args.batch}")
    bad = [m for m in args.modes if m not in modes.names()]
    if bad:
        _fail(f"bench: --modes takes {','.join(modes.names())}; got {bad}")
    if args.transports is None:
        args.transports = ["torch"] + (["fast"] if unavailable_reason(device) is None else [])
    bad = [t for t in args.transports if t not in ("torch", "fast", "auto")]
    if bad:
        _fail(f"bench: --transports takes torch,fast,auto; got {bad}")
    if "fast" in args.transports and (why := unavailable_reason(device)) is not None:
        _fail(f"bench: transport 'fast' cannot run: {why}")
    bad = [s for s in args.seqs if s < world or s % world]
    if bad and not seqs_given:  # e.g. --nproc 3 with the default S: say so, and offer multiples of W
        near = ",".join(str(max(world, s - s % world)) for s in args.seqs)
        _fail(f"bench: the default S {args.seqs} are not all multiples of the CP world size {world}; give --seqs, "
              f"e.g. --seqs {near}")
    if bad:
        _fail(f"bench: every S in --seqs must be a positive multiple of the CP world size {world}; got {bad}")
    if args.heads % world and all(m != "auto" and modes.spec(m).needs_heads_divisible for m in args.modes):
        _fail(f"bench: mode {','.join(args.modes)} needs the CP world size {world} to divide --heads {args.heads}; "
              "pick other heads or add --modes agkv")
    args.calls = (10 if gpu else 1) if getattr(args, "calls", None) is None else args.calls
    args.chunks = getattr(args, "chunks", [1])
    if args.calls < 1:
        _fail(f"bench: --calls must be >= 1; got {args.calls}")
    if not args.chunks:
        _fail("bench: --chunks is empty; give e.g. --chunks 1,2,4,auto")
    if getattr(args, "graphs", False) and not gpu:
        _fail(f"bench: --graphs needs CUDA GPUs (it captures CUDA graphs); this run is on {device}: drop --graphs")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        _fail("bench: --plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')")
    if "fast" in args.transports and settings.sources.get("fast_pool_gb") == "default":
        from .bench import DTYPES, fast_pool_gib

        need = fast_pool_gib(args.seqs, args.batch, args.heads, args.head_dim, DTYPES[args.dtype], world,
                             tuple(args.chunks) + ((None,) if "auto" in args.modes else ()))
        if need > settings.fast_pool_gb - 1:  # leave room for the pool's control block
            args.settings["fast_pool_gb"] = math.ceil(need * 1.1)
            if _rank0():
                print(f"cp-ops bench: these shapes fill {need:.1f} GiB of the fast transport's symmetric pool; "
                      f"using fast_pool_gb={args.settings['fast_pool_gb']} (set CP_OPS_FAST_POOL_GB to override)")


def _check_run(args, device: str, world: int) -> None:
    from .models import MODELS
    from cp_ops.transport.fast import unavailable_reason

    what = f"run {args.model}"
    if importlib.util.find_spec("diffusers") is None:
        _fail(f"{what} needs diffusers: pip install -e '.[diffusers]' (or pip install diffusers)")
    spec = MODELS[args.model]
    gpu = device == "cuda"
    if args.checkpoint:
        if args.config or args.layers is not None:
            _fail(f"{what}: --checkpoint takes the checkpoint's config; drop --config/--layers")
        if not os.path.isdir(args.checkpoint):
            _fail(f"{what}: --checkpoint {args.checkpoint} is not a folder")
        import json as _json

        sub = os.path.join(args.checkpoint, "transformer", "config.json")
        cfg_file = sub if os.path.isfile(sub) else os.path.join(args.checkpoint, "config.json")
        if not os.path.isfile(cfg_file):
            _fail(f"{what}: --checkpoint {args.checkpoint}: no config.json there nor in its transformer/ folder")
        with open(cfg_file) as f:
            cfg = _json.load(f)
        if cfg.get("_class_name") != spec.cls:
            _fail(f"{what}: --checkpoint {args.checkpoint} holds a {cfg.get('_class_name')}; {what} takes a {spec.cls}")
        args.config = "checkpoint"
        text = spec.text_tokens[spec.gpu_config] if gpu else 16
    else:
        args.config = args.config or (spec.gpu_config if gpu else "tiny")
        if args.config not in spec.configs:
            _fail(f"{what}: --config takes {'|'.join(spec.configs)}; got {args.config!r}")
        cfg = spec.config(args.config, args.layers)
        text = spec.text_tokens[args.config]
    args.text_tokens = text if args.text_tokens is None else args.text_tokens
    f0, h0, w0 = spec.gpu_latent if gpu else spec.cpu_latent
    args.frames = f0 if args.frames is None else args.frames
    height_given = args.height is not None
    args.height = h0 if args.height is None else args.height
    args.width = (args.height if height_given else w0) if args.width is None else args.width  # help: "as --height"
    pt, ph, pw = spec.patch(cfg)
    if args.layers is not None and args.layers < 1:
        _fail(f"{what}: --layers must be >= 1; got {args.layers}")
    if not spec.video and args.frames != 1:
        _fail(f"{what}: {spec.cls} is an image model; --frames must be 1, got {args.frames}")
    if min(args.frames, args.height, args.width, args.batch) < 1 or args.height % ph or args.width % pw or args.frames % pt:
        _fail(f"{what}: latent --frames/--height/--width must be positive multiples of the patch "
              f"{[pt, ph, pw]} and --batch >= 1; got {args.frames}/{args.height}/{args.width}, batch {args.batch}")
    if args.text_tokens < 1:
        _fail(f"{what}: --text-tokens must be >= 1; got {args.text_tokens}")
    cp = world
    if args.cfg:
        if world < 2 or world % 2:
            _fail(f"{what}: --cfg splits the ranks into 2 CFG lanes; the CP world size must be even, got {world}")
        cp = world // 2
    heads = cfg.get(spec.heads_key)
    if heads and args.mode != "auto" and modes.spec(args.mode).needs_heads_divisible and heads % cp:
        _fail(f"{what}: mode {args.mode} needs the CP world size {cp} to divide the {heads} heads of "
              f"{args.model} {args.config}; use --mode agkv")
    if args.transport == "fast" and (why := unavailable_reason(device)) is not None:
        _fail(f"{what}: transport 'fast' cannot run: {why}")
    if args.no_overlap and not args.compile:
        _fail(f"{what}: --no-overlap only applies with --compile")
    if args.cuda_graphs and not gpu:
        _fail(f"{what}: --cuda-graphs needs CUDA (CUDA graphs record GPU work); this run is on the CPU")
    if args.cuda_graphs and args.steps and not args.compile:
        _fail(f"{what}: --cuda-graphs with --steps needs --compile (mode='reduce-overhead'); the explicit "
              "capture replays one forward on fixed inputs")
    if args.steps < 0:
        _fail(f"{what}: --steps must be >= 0; got {args.steps}")
    if args.profile:
        if os.path.exists(args.profile) and not os.path.isdir(args.profile):
            _fail(f"{what}: --profile {args.profile} is a file; give a folder for the traces")
        if args.profile_runs < 1:
            _fail(f"{what}: --profile-runs must be >= 1; got {args.profile_runs}")
    if args.bound is not None:
        _check_bound(args, what, spec, cfg, gpu)
    elif args.bound_compile or args.cost or args.no_group1 or args.random_memory:
        _fail(f"{what}: --bound-compile, --cost, --no-group1 and --random-memory apply only with --bound W[,W...]")


def _check_bound(args, what: str, spec, cfg, gpu: bool) -> None:
    """``run --bound``: one process, a fake group of each W (see :mod:`cp_ops.cli.bound`)."""
    from .bound import DEFAULT_CPU, DEFAULT_CUDA, parse_mode

    from .launch import under_torchrun

    if under_torchrun():
        _fail(f"{what} --bound runs in one process on one device (a fake group stands in for the ranks); "
              "run it without torchrun")
    if not args.bound or min(args.bound) < 1:
        _fail(f"{what}: --bound takes CP world sizes >= 1, e.g. --bound 2,4,8; got {args.bound}")
    for flag, bad in (("--compare", args.compare), ("--steps", args.steps), ("--cfg", args.cfg),
                      ("--transport fast", args.transport == "fast")):
        if bad:
            _fail(f"{what}: {flag} does not apply with --bound (one process, fake groups: nothing is transferred, "
                  "the transport is 'torch')")
    if args.compile or args.cuda_graphs:
        if args.bound_compile:
            _fail(f"{what}: give the compile modes either as --bound-compile or as --compile/--cuda-graphs, not both")
        args.bound_compile = [(args.compile or "eager") + ("+graphs" if args.cuda_graphs else "")]
    args.bound_compile = args.bound_compile or list(DEFAULT_CUDA if gpu else DEFAULT_CPU)
    for m in args.bound_compile:
        try:
            _, graphs = parse_mode(m)
        except ValueError as e:
            _fail(f"{what}: --bound-compile: {e}")
        if graphs and not gpu:
            _fail(f"{what}: --bound-compile {m} needs CUDA (CUDA graphs record GPU work); this run is on the CPU")
    heads = cfg.get(spec.heads_key)
    for w in args.bound:
        if heads and args.mode != "auto" and modes.spec(args.mode).needs_heads_divisible and heads % w:
            _fail(f"{what}: mode {args.mode} needs W={w} to divide the {heads} heads; use --mode agkv or --mode auto")
    tokens = spec.tokens(cfg, args.frames, args.height, args.width)
    top = max(args.bound)
    if tokens < top or args.text_tokens < top:
        _fail(f"{what} --bound {top}: every rank needs at least one token of each split stream; got {tokens} image "
              f"and {args.text_tokens} text tokens (raise --height/--width or --text-tokens)")
    args.chunks = 1 if args.chunks is None else args.chunks


def _check_generate(args, device: str, world: int) -> None:
    if importlib.util.find_spec("diffusers") is None:
        _fail("generate needs diffusers: pip install -e '.[diffusers]' (or pip install diffusers)")
    if not os.path.isfile(os.path.join(args.checkpoint, "model_index.json")):
        _fail(f"generate: --checkpoint {args.checkpoint} has no model_index.json (not a diffusers pipeline folder)")
    if args.prompt_embeds and not os.path.isfile(args.prompt_embeds):
        _fail(f"generate: --prompt-embeds {args.prompt_embeds} is not a file")
    args.steps = (30 if device == "cuda" else 2) if args.steps is None else args.steps
    if args.steps < 1:
        _fail(f"generate: --steps must be >= 1; got {args.steps}")
    for k in ("height", "width", "frames"):
        v = getattr(args, k)
        if v is not None and v < 1:
            _fail(f"generate: --{k} must be >= 1; got {v}")
    if args.transport == "fast":
        from cp_ops.transport.fast import unavailable_reason

        if (why := unavailable_reason(device)) is not None:
            _fail(f"generate: transport 'fast' cannot run: {why}")
    if args.out and os.path.splitext(args.out)[1].lower() not in (".png", ".mp4"):
        _fail(f"generate: --out must end in .png or .mp4; got {args.out}")


def _check_out(path: str | None, flag: str) -> None:
    """Fail before the run when ``path`` cannot be written; say when it will be overwritten."""
    if not path:
        return
    full = os.path.abspath(path)
    if os.path.isdir(full):
        _fail(f"{flag} {path} is a directory; give a file path")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        _fail(f"{flag} {path}: cannot write under {parent}")
    exists = os.path.exists(full)
    if exists and not os.access(full, os.W_OK):
        _fail(f"{flag} {path} exists and is not writable")
    try:  # os.access says yes to root everywhere (e.g. /proc, root-squashed NFS): try the write itself
        if exists:
            open(full, "ab").close()  # appends nothing: the file is unchanged
        else:
            tempfile.TemporaryFile(dir=parent).close()
    except OSError as e:
        _fail(f"{flag} {path}: cannot write under {parent} ({e.strerror})")
    if exists:
        if _rank0():
            print(f"cp-ops: {flag} {path} exists; it will be overwritten", flush=True)


def load_settings():
    """``cp_ops.config.settings``; a bad ``CP_OPS_*`` value becomes a :class:`UsageError` (its one line)."""
    try:
        from cp_ops import config
    except ValueError as e:  # cp_ops.config.ConfigError: parsed once at import
        if type(e).__name__ != "ConfigError":
            raise
        _fail(str(e))
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
        _say_once(f"cp-ops: {e}")
        return 2


def _main(args) -> int:
    if args.cmd == "env":
        from .env_report import print_env

        return print_env()
    settings = load_settings()
    import torch
    import torch.multiprocessing as mp

    from .launch import launch, under_torchrun

    device = _device(args)
    gpu = device == "cuda"
    if args.nproc is None:
        args.nproc = torch.cuda.device_count() if gpu else 2
    if args.nproc < 1:
        _fail(f"--nproc must be >= 1; got {args.nproc}")
    if gpu and not under_torchrun() and torch.cuda.device_count() < args.nproc:
        _fail(f"--nproc {args.nproc} needs {args.nproc} visible GPUs; found {torch.cuda.device_count()} "
              "(lower --nproc or use --device cpu)")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.nproc
    if args.dtype is None:
        args.dtype = "bf16" if gpu else "fp32"
    args.settings = {}
    if args.cmd == "generate":
        from .generate import generate as body

        _check_generate(args, device, world)
        _check_out(args.out, "--out")
        launch(_rank_entry, args.nproc, device, body, args)
        return 0
    bound = args.cmd == "run" and args.bound is not None
    args.warmup = args.warmup if args.warmup is not None else (2 if bound else 5) if gpu else (1 if bound else 2)
    args.repeats = args.repeats if args.repeats is not None else (
        5 if args.cmd == "bench" or bound else 20 if gpu else 10)
    if args.repeats < 1 or args.warmup < 0:
        _fail(f"--repeats must be >= 1 and --warmup >= 0; got {args.repeats}, {args.warmup}")
    if args.cmd == "bench":
        from .bench import run_bench as body

        _check_bench(args, device, world, settings)
        _check_out(args.plot, "--plot")
    else:
        from .run import run_model as body

        _check_run(args, device, world)
    _check_out(args.out, "--out")
    if bound:  # one process, this device: no ranks to launch
        from .bound import run_bound

        if args.settings:
            from cp_ops import config

            config.configure(**args.settings)
        run_bound(args, torch.device(device, 0) if gpu else torch.device("cpu"))
        return 0
    try:
        launch(_rank_entry, args.nproc, device, body, args)
    except mp.ProcessExitedException as e:  # a rank's sys.exit(code): e.g. run's UNSUPPORTED (its line is printed)
        return e.exit_code or 1
    if not under_torchrun():
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
