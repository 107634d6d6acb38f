"""``cp-ops generate``: a whole local diffusers pipeline with its transformer under CP.

Every rank loads the pipeline (``null`` components as None), parallelizes its transformer and runs the same seeded
sampling call (only the transformer's tokens are split). Rank 0 shows the progress bar and writes an image as PNG, a
video as MP4 where an encoder is installed, else as a PNG grid of the frames (the output says which).

``--prompt-embeds FILE``: a ``torch.save``'d tensor ``[B, L, dim]`` (``prompt_embeds``) or a dict of pipeline keyword
tensors, for pipelines saved without a text encoder. Without negative embeddings the guidance scale is 1 (the
pipeline could not encode the empty negative prompt).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time

import torch
import torch.distributed as dist

from .bench import DTYPES, available_cores
from .run import _sync, exit_unsupported


def load_pipeline(path: str, dtype: torch.dtype, device: torch.device):
    """``DiffusionPipeline.from_pretrained(path, dtype=dtype)`` (older: ``torch_dtype=``) on ``device``; nulls: None."""
    from diffusers import DiffusionPipeline

    from .models import dtype_kwarg

    with open(os.path.join(path, "model_index.json")) as f:
        index = json.load(f)
    nulls = {k: None for k, v in index.items() if v == [None, None]}
    pipe = DiffusionPipeline.from_pretrained(path, **dtype_kwarg(dtype), **nulls)
    return pipe.to(device)


def _call_kwargs(pipe, args, device) -> dict:
    params = inspect.signature(pipe.__call__).parameters
    kw = dict(num_inference_steps=args.steps, generator=torch.Generator(device="cpu").manual_seed(args.seed))
    if args.prompt_embeds:
        loaded = torch.load(args.prompt_embeds, map_location=device, weights_only=True)
        extra = loaded if isinstance(loaded, dict) else {"prompt_embeds": loaded}
        unknown = [k for k in extra if k not in params]
        if unknown:
            raise ValueError(f"--prompt-embeds {args.prompt_embeds}: {type(pipe).__name__} takes no {unknown}")
        kw.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extra.items()})
        if "negative_prompt_embeds" not in extra and "guidance_scale" in params and args.guidance is None:
            kw["guidance_scale"] = 1.0
    else:
        kw["prompt"] = args.prompt
    for name, value in (("height", args.height), ("width", args.width), ("num_frames", args.frames),
                        ("guidance_scale", args.guidance)):
        if value is None:
            continue
        if name not in params:
            raise ValueError(f"{type(pipe).__name__} takes no {name} (from --{name.replace('num_', '')})")
        kw[name] = value
    if "output_type" in params:
        kw["output_type"] = "np"
    return kw


def _frames(result):
    """The output as float ``[F, H, W, 3]`` in [0, 1] (F = 1 for an image) and whether it is a video."""
    import numpy as np

    if hasattr(result, "frames"):
        return np.asarray(result.frames[0]), True
    return np.asarray(result.images[0])[None], False


def write(frames, video: bool, out: str) -> str:
    """Write ``frames`` (float ``[F, H, W, 3]`` in [0, 1]) as a video, else a PNG grid (one frame: the image); returns
    the path written (a ``.png`` grid replaces an ``.mp4`` that no installed encoder can write)."""
    import numpy as np
    from PIL import Image

    u8 = (np.clip(frames, 0, 1) * 255).round().astype("uint8")
    if video and out.lower().endswith(".mp4"):
        try:
            from diffusers.utils import export_to_video

            export_to_video(list(frames), out, fps=16)
            return out
        except (ImportError, AttributeError, RuntimeError, OSError) as e:
            png = os.path.splitext(out)[0] + ".png"
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}" if str(e) else type(e).__name__
            print(f"cp-ops generate: no video encoder ({why}); "
                  f"writing the {len(frames)} frames as a PNG grid {png} (pip install imageio imageio-ffmpeg for MP4)")
            out = png
    cols = math.ceil(math.sqrt(len(u8)))
    rows = math.ceil(len(u8) / cols)
    f, h, w, c = u8.shape
    grid = np.zeros((rows * h, cols * w, c), dtype="uint8")
    for i, fr in enumerate(u8):
        grid[(i // cols) * h:(i // cols + 1) * h, (i % cols) * w:(i % cols + 1) * w] = fr
    Image.fromarray(grid).save(out)
    return out


def parallelize_transformers(pipe, args) -> None:
    """:func:`cp_ops.integrations.diffusers.parallelize` on ``pipe.transformer`` (and ``pipe.transformer_2``: Wan 2.2
    A14B's second expert) with ``--mode``, ``--transport`` and ``--comm-dtype``. Raises as ``parallelize``."""
    from cp_ops.comm_dtype import parse
    from cp_ops.integrations.diffusers import parallelize

    fmts = parse(str(getattr(args, "comm_dtype", "none")))
    for name in ("transformer", "transformer_2"):
        if getattr(pipe, name, None) is not None:
            parallelize(getattr(pipe, name), mode=args.mode, transport=args.transport, comm_dtype=fmts)


def generate(rank: int, world_size: int, device: torch.device, args) -> None:
    """Rank body of ``cp-ops generate`` (arguments checked by :mod:`cp_ops.cli.main`)."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, available_cores() // world_size))
    if rank != 0:  # one progress bar (rank 0's): no loading bars from the other ranks either
        from diffusers.utils import logging as dlogging

        dlogging.disable_progress_bar()
    pipe = load_pipeline(args.checkpoint, DTYPES[args.dtype], device)
    if getattr(pipe, "transformer", None) is None:
        raise ValueError(f"generate: the pipeline {type(pipe).__name__} at {args.checkpoint} has no transformer")
    try:
        parallelize_transformers(pipe, args)
    except ValueError as e:
        if "support" not in str(e):
            raise
        exit_unsupported(rank, f"cp-ops generate: cp_ops.parallelize does not support "
                               f"{type(pipe.transformer).__name__} here: {e}")
    pipe.set_progress_bar_config(disable=rank != 0, desc=f"CP{world_size} steps")
    kw = _call_kwargs(pipe, args, device)
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        result = pipe(**kw)
    _sync(device)
    seconds = time.perf_counter() - t0
    if rank == 0:
        frames, video = _frames(result)
        out = args.out or ("out.mp4" if video else "out.png")
        path = write(frames, video, out)
        kind = f"video, {len(frames)} frames" if video else "image"
        print(f"cp-ops generate: {type(pipe).__name__} ({type(pipe.transformer).__name__} under CP{world_size}), "
              f"{args.steps} steps in {seconds:.1f} s ({kind} {frames.shape[2]}x{frames.shape[1]}): wrote {path}")
    dist.barrier()
