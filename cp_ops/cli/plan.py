"""``cp-ops plan MODEL --gpus N``: the layout ``parallelize_pipeline`` plans for the model's diffusers pipeline on N
GPUs (:mod:`cp_ops.integrations.diffusers.planner`), its predicted step time beside the alternatives and one GPU's.
Runs nothing: the model's GPU config and resolution (or ``--config``, ``--layers``, ``--frames/--height/--width``),
the path ``parallelize`` takes on CUDA (the whole forward captured; ``--compile``: regional compile + capture)."""

from __future__ import annotations

#: the diffusers pipeline each ``cp-ops run`` model ships in (its CFG decides the lanes)
PIPELINES = {"wan": "WanPipeline", "qwenimage": "QwenImagePipeline", "flux": "FluxPipeline",
             "hunyuanvideo": "HunyuanVideoPipeline", "ltx": "LTXPipeline", "zimage": "ZImagePipeline"}


def print_plan(args) -> int:
    """Print the plan for ``args.model`` on ``args.gpus`` GPUs (``args`` filled for CUDA by check_model); returns 0."""
    from ..integrations.diffusers import planner
    from ..integrations.diffusers.lanes import cfg_kind
    from .models import config_label
    from ._args import fail
    from .run_args import check_model

    what = f"plan {args.model}"
    if args.gpus < 1:
        fail(f"{what}: --gpus takes the GPU count N >= 1; got {args.gpus}")
    if args.cfg and args.gpus % 2:
        fail(f"{what}: --cfg needs an even --gpus; got {args.gpus} (two equal CFG lanes; drop --cfg to have the "
             "lanes planned)")
    spec, cfg = check_model(args, "cuda", what)  # first: it names the missing diffusers
    import diffusers

    pipe = PIPELINES[args.model]
    cls = getattr(diffusers, pipe)
    if type(cls).__name__ == "DummyObject":  # diffusers' placeholder where a backend is missing: no defaults to read
        missing = [b for b in getattr(cls, "_backends", ()) if b != "torch"] or ["transformers"]
        fail(f"{what} needs {', '.join(missing)} (it reads {pipe}'s CFG defaults): "
             f"pip install -e '.[generate]' (or pip install {' '.join(missing)})")
    kind = cfg_kind(cls)
    tokens = spec.tokens(cfg, args.frames, args.height, args.width) * args.batch
    path = "regional+capture" if args.compile else "eager+graphs"
    kw = dict(cfg=kind, config=cfg, tokens=tokens, path=path, mode=args.mode)
    p = planner.plan(spec.cls, args.gpus, lanes=2 if args.cfg else None, **kw)
    one = planner.plan(spec.cls, 1, **kw).layout.step_ms
    print(f"cp-ops plan {args.model} --gpus {args.gpus}: {spec.cls} {config_label(spec, args.config, cfg)}, latent "
          f"{args.frames}x{args.height}x{args.width} ({tokens} tokens), {pipe} (CFG: {kind or 'off by default'}), "
          f"{args.gpus} GPUs on one node")
    print(p)
    if p.layout.step_ms is not None:
        print(f"one GPU: {one:.1f} ms per step -> {p.layout.step_ms:.1f} ms on {args.gpus} GPUs "
              f"({one / p.layout.step_ms:.2f}x). Bound = rank 0's forward measured on one H200 with no link "
              "(a ceiling); comm = the link model (cp_ops/cost.py: H200 NVLink measured), exposed in full")
    return 0
