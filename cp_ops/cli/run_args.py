"""``cp-ops run``'s arguments: its parser and checks (torch-free until a check needs the core); the model and input
arguments it shares with ``cp-ops bound`` (:mod:`.bound_args`): :func:`add_model`, :func:`check_model`."""

from __future__ import annotations

import importlib.util
import os

from .. import modes
from ._args import add_mesh, check_comm_dtype, check_mesh, chunks_arg, common, fail, whole_capture

#: ``cp-ops run`` model names (cp_ops.cli.models.MODELS, listed here so --help needs no torch import)
MODEL_NAMES = ("wan", "zimage", "flux", "qwenimage", "hunyuanvideo", "ltx")


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="a diffusers DiT (Wan, Z-Image, Flux, Qwen-Image, HunyuanVideo, LTX-Video; random weights or "
                                   "--checkpoint): one forward or --steps N, single rank vs CP",
                       description="The model's released config with random seeded weights (or a local checkpoint's "
                                   "transformer), the same inputs on every rank: the single-rank model on rank 0, "
                                   "(--compare diffusers) diffusers' own CP, then cp_ops.parallelize; time (re-timed "
                                   "at the end in --repeats interleaved rounds), speedup, max relative error. Sizes "
                                   "are latent (pixels / 8; LTX-Video: pixels / 32, frames (n - 1) / 8 + 1). The "
                                   "zero-communication bound (--bound, --cost, --unwritten, --no-group1, "
                                   "--side-processes, --compile-workers) is its own command: cp-ops bound MODEL "
                                   "--worlds W[,W...]; so is the planned layout: cp-ops plan MODEL --gpus N.")
    r.add_argument("model", choices=list(MODEL_NAMES), help="the model family")
    common(r, "timed forwards per side, and the interleaved rounds that give the final times (without --steps "
               "and --cuda-graphs); the median is reported (default 20 GPU, 10 CPU; with "
               "--steps N: unused, one timed loop, its median step)")
    add_model(r)
    r.add_argument("--transport", choices=["auto", "torch", "fast"], default="auto",
                   help="torch (torch.distributed: NCCL/gloo), fast (NVSHMEM/P2P, one Hopper node), "
                        "auto (fast where it can run, else torch; `cp-ops env` says which)")
    r.add_argument("--comm-dtype", default="none", metavar="{none,e4m3,e5m2,e4m3:qvo,...}",
                   help="what CP attention sends over the link (parallelize(..., comm_dtype=)): none (default) = the "
                        "model's dtype; e4m3/e5m2 = FP8; FMT:LETTERS = only those of q,k,v,o (e4m3:qvo). docs/fp8.md")
    r.add_argument("--compile", nargs="?", const="regional", choices=["regional", "full"], default=None,
                   help="compile every side with cp_ops.compile (torch.compile(fullgraph=True) + the K/V overlap "
                        "pass): regional (default) = each repeated block, as diffusers' compile_repeated_blocks "
                        "(seconds); full = the whole model. The first call's time (compile included) is reported")
    r.add_argument("--no-overlap", action="store_true",
                   help="with --compile: plain torch.compile(fullgraph=True), without the overlap pass")
    r.add_argument("--cuda-graphs", nargs="?", const=True, default=False, choices=["forward"],
                   help="CUDA-graph replay (CUDA only). Bare: with --compile, per-block graphs (mode='reduce-overhead'"
                        "); without, the whole eager forward in one graph. 'forward': the whole forward in one graph, "
                        "also after --compile. Give it after MODEL (before MODEL it would take MODEL as its value)")
    r.add_argument("--steps", type=int, default=0,
                   help="a denoising loop of N steps (the model's diffusers scheduler, the transformer called N "
                        "times): time per step and total (default 0: one forward)")
    r.add_argument("--cfg", action="store_true",
                   help="CFG-parallel layout: conditional and unconditional batch halves on two halves of the "
                        "ranks, CP inside each (parallelize(..., cfg_parallel=True); W even)")
    add_mesh(r, "; the model is parallelized on it (parallelize(group=mesh); with --cfg a ('cfg', 'agkv', 'ulysses') "
                "mesh: O x I = W / 2); --mode auto")
    r.add_argument("--compare", choices=["diffusers"], default=None,
                   help="also run diffusers' native context parallelism (enable_parallelism, Ulysses and ring) "
                        "on the same model and inputs; rows beside cp_ops'")
    r.add_argument("--profile", default=None, metavar="DIR",
                   help="profile the CP run (torch.profiler): Chrome traces DIR/trace_rank*.json.gz and a per-layer "
                        "breakdown")
    r.add_argument("--profile-runs", type=int, default=3, help="forwards in the --profile trace (default 3)")


def add_model(r) -> None:
    """The model and its inputs: what ``cp-ops run`` and ``cp-ops bound`` both take."""
    r.add_argument("--config", default=None,
                   help="released config: wan 1.3b|14b, zimage turbo, flux dev|schnell, qwenimage 20b, "
                        "hunyuanvideo 13b, ltx 2b; tiny for any (default: the first on GPU, tiny on CPU)")
    r.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="load the transformer of this local diffusers checkpoint (pipeline folder or its "
                        "transformer/ folder) instead of random weights")
    r.add_argument("--layers", type=int, default=None,
                   help="cut depth to N blocks of each kind (Flux, HunyuanVideo: N double- and N single-stream)")
    r.add_argument("--frames", type=int, default=None, help="latent frames (video models; default on GPU the model's standard length: wan 21 (81 "
                        "frames), hunyuanvideo 16 (61 frames), ltx 16 (121 frames); 2 CPU; image models 1)")
    r.add_argument("--height", type=int, default=None, help="latent height (pixels / 8; default on GPU the model's standard resolution: wan 60x104 "
                        "(480p), hunyuanvideo 68x120 (544x960), ltx 16x24 (768x512, pixels / 32), flux/zimage 128 (1024²), "
                        "qwenimage 166 (1328²); 16 CPU, ltx 8)")
    r.add_argument("--width", type=int, default=None,
                   help="latent width (pixels / 8; default: as --height when --height is given, else the model's)")
    r.add_argument("--text-tokens", type=int, default=None, help="text sequence length (default: the model's, in cp_ops/cli/models.py)")
    r.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    r.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default bf16 GPU, fp32 CPU")
    r.add_argument("--mode", choices=modes.names(), default="auto",
                   help="CP attention mode: agkv (gather K/V, keep local Q), ulysses (all-to-all sequence<->heads; "
                        "W must divide the heads), auto (agkv at W = 2; from W = 3 ulysses when W divides the heads, else agkv)")
    r.add_argument("--chunks", type=chunks_arg, default=None, metavar="{auto,1,2,3,4,...}",
                   help="pipeline stages of every CP attention call (parallelize(..., chunks=)): 1 = "
                        "transport-then-attend (bitwise equal to one GPU); k >= 2 = pipelined in k stages "
                        "(communication under attention); auto (default) = the heuristic (2 for agkv on the fast "
                        "transport, else 1; measured on the first eager call only with CP_OPS_TUNE_MODES=1). Calls on uneven "
                        "shards or with a key mask use 1")


def check_model(args, device: str, what: str):
    """Check the model and input arguments (:func:`add_model`) and fill in the defaults that depend on the device and
    the model; returns ``(spec, cfg)``. A wrong one raises :class:`~cp_ops.cli._args.UsageError`."""
    from .models import MODELS

    if importlib.util.find_spec("diffusers") is None:
        fail(f"{what} needs diffusers: pip install -e '.[diffusers]' (or pip install diffusers)")
    spec = MODELS[args.model]
    gpu = device == "cuda"
    if args.checkpoint:
        if args.config or args.layers is not None:
            fail(f"{what}: --checkpoint takes the checkpoint's config; drop --config/--layers")
        if not os.path.isdir(args.checkpoint):
            fail(f"{what}: --checkpoint {args.checkpoint} is not a folder")
        from .models import checkpoint_config

        try:
            cfg = checkpoint_config(args.checkpoint)
        except ValueError:
            fail(f"{what}: --checkpoint {args.checkpoint}: no config.json there nor in its transformer/ folder")
        if cfg.get("_class_name") != spec.cls:
            fail(f"{what}: --checkpoint {args.checkpoint} holds a {cfg.get('_class_name')}; {what} takes a {spec.cls}")
        args.config = "checkpoint"
        text = spec.text_tokens[spec.gpu_config] if gpu else 16
    else:
        args.config = args.config or (spec.gpu_config if gpu else "tiny")
        if args.config not in spec.configs:
            fail(f"{what}: --config takes {'|'.join(spec.configs)}; got {args.config!r}")
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
        fail(f"{what}: --layers must be >= 1; got {args.layers}")
    if not spec.video and args.frames != 1:
        fail(f"{what}: {spec.cls} is an image model; --frames must be 1, got {args.frames}")
    if min(args.frames, args.height, args.width, args.batch) < 1 or args.height % ph or args.width % pw or args.frames % pt:
        fail(f"{what}: latent --frames/--height/--width must be positive multiples of the patch "
              f"{[pt, ph, pw]} and --batch >= 1; got {args.frames}/{args.height}/{args.width}, batch {args.batch}")
    if args.text_tokens < 1:
        fail(f"{what}: --text-tokens must be >= 1; got {args.text_tokens}")
    return spec, cfg


def check(args, device: str, world: int) -> None:
    """Check ``cp-ops run``'s arguments and fill in the defaults that depend on the device and the model; a wrong
    one raises :class:`~cp_ops.cli._args.UsageError` (via :func:`~cp_ops.cli._args.fail`)."""
    from cp_ops.transport.fast import unavailable_reason

    what = f"run {args.model}"
    spec, cfg = check_model(args, device, what)
    gpu = device == "cuda"
    check_comm_dtype(args, what)
    cp = world
    if args.cfg:
        if world < 2 or world % 2:
            fail(f"{what}: --cfg splits the ranks into 2 CFG lanes; the CP world size must be even, got {world}")
        cp = world // 2
    heads = cfg.get(spec.heads_key)
    if getattr(args, "mesh", None) is not None:
        if args.mode != "auto":
            fail(f"{what}: --mesh runs the 2-D mode (mode 'auto' on the mesh); got --mode {args.mode}: drop --mode")
        check_mesh(args, what, cp, heads, " (of each CFG lane: W / 2 with --cfg)" if args.cfg else "",
                   lanes=2 if args.cfg else 1)
    elif heads and args.mode != "auto" and modes.spec(args.mode).needs_heads_divisible and heads % cp:
        fail(f"{what}: mode {args.mode} needs the CP world size {cp} to divide the {heads} heads of "
              f"{args.model} {args.config}; use --mode agkv")
    if args.transport == "fast" and (why := unavailable_reason(device)) is not None:
        fail(f"{what}: transport 'fast' cannot run: {why}")
    if args.no_overlap and not args.compile:
        fail(f"{what}: --no-overlap only applies with --compile")
    if args.cuda_graphs and not gpu:
        fail(f"{what}: --cuda-graphs needs CUDA (CUDA graphs record GPU work); this run is on the CPU")
    if whole_capture(args) and args.steps:
        fail(f"{what}: --steps with a whole-forward capture (--cuda-graphs without --compile, or --cuda-graphs "
             "forward): the explicit capture replays one forward on fixed inputs; time a loop with --compile "
             "--cuda-graphs (mode='reduce-overhead' per block)")
    if args.steps < 0:
        fail(f"{what}: --steps must be >= 0; got {args.steps}")
    if args.profile:
        if os.path.exists(args.profile) and not os.path.isdir(args.profile):
            fail(f"{what}: --profile {args.profile} is a file; give a folder for the traces")
        if args.profile_runs < 1:
            fail(f"{what}: --profile-runs must be >= 1; got {args.profile_runs}")
