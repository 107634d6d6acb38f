"""``cp-ops generate``'s arguments: its parser and checks."""

from __future__ import annotations

import importlib.util
import os

from .. import modes
from ._args import check_comm_dtype, fail


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="a whole local diffusers pipeline, its transformer under CP: writes the "
                                          "image (PNG) or video (MP4, or a PNG grid of frames)",
                         description="DiffusionPipeline.from_pretrained(--checkpoint), its transformer parallelized "
                                     "with cp_ops; every rank runs the same sampling loop (same seed), rank 0 "
                                     "writes the result and shows the pipeline's progress bar.")
    gen.missing_hint = ("no pipeline folder at hand: torchrun --nproc-per-node 2 -m cp_ops.examples.generate runs a "
                        "tiny random one on the CPU")
    gen.add_argument("--checkpoint", required=True, metavar="DIR",
                     help="a local diffusers pipeline folder (none at hand: `torchrun --nproc-per-node 2 -m "
                          "cp_ops.examples.generate` runs a tiny random Wan 2.2-style pipeline on the CPU)")
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
    gen.add_argument("--comm-dtype", default="none", metavar="{none,e4m3,e5m2,e4m3:qvo,...}",
                     help="what CP attention sends over the link, as in run (default none: the pipeline's dtype; "
                          "docs/fp8.md)")


def check(args, device: str, world: int) -> None:
    """Check ``cp-ops generate``'s arguments (the checkpoint, steps, sizes, transport, comm dtype, output suffix)."""
    check_comm_dtype(args, "generate")  # the argument alone first
    if importlib.util.find_spec("diffusers") is None:
        fail("generate needs diffusers (and a pipeline's text encoder: transformers): pip install -e '.[generate]'")
    if not os.path.isfile(os.path.join(args.checkpoint, "model_index.json")):
        fail(f"generate: --checkpoint {args.checkpoint} has no model_index.json (not a diffusers pipeline folder)")
    if args.prompt_embeds and not os.path.isfile(args.prompt_embeds):
        fail(f"generate: --prompt-embeds {args.prompt_embeds} is not a file")
    args.steps = (30 if device == "cuda" else 2) if args.steps is None else args.steps
    if args.steps < 1:
        fail(f"generate: --steps must be >= 1; got {args.steps}")
    for k in ("height", "width", "frames"):
        v = getattr(args, k)
        if v is not None and v < 1:
            fail(f"generate: --{k} must be >= 1; got {v}")
    if args.transport == "fast":
        from cp_ops.transport.fast import unavailable_reason

        if (why := unavailable_reason(device)) is not None:
            fail(f"generate: transport 'fast' cannot run: {why}")
    if args.out and os.path.splitext(args.out)[1].lower() not in (".png", ".mp4"):
        fail(f"generate: --out must end in .png or .mp4; got {args.out}")

