"""A diffusers pipeline on W GPUs (or CPU processes) under context parallelism; rank 0 saves the result.

    torchrun --nproc-per-node 2 -m cp_ops.examples.generate                       # tiny Wan 2.2-style pipeline, CPU
    torchrun --nproc-per-node 8 -m cp_ops.examples.generate --checkpoint Wan-AI/Wan2.2-T2V-A14B-Diffusers \\
        --prompt "a red fox in the snow" --out fox.gif
"""
import argparse
import os
import sys

import torch
try:
    from diffusers import DiffusionPipeline
    from diffusers.utils import export_to_gif
    import transformers  # noqa: F401  (diffusers' Wan pipeline needs it)
except ImportError as e:  # the example's own dependencies: say which extra brings them
    raise SystemExit(f"cp_ops.examples.generate needs diffusers and transformers: pip install -e '.[generate]' "
                     f"(or pip install 'cp_ops[generate]'); {e}") from None

from cp_ops.examples.tiny import tiny_wan22
from cp_ops.integrations.diffusers import parallelize_pipeline

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--checkpoint", help="a diffusers pipeline (hub id or folder); without it a tiny random one, no download")
p.add_argument("--prompt", default="a red fox in the snow", help="with --checkpoint")
p.add_argument("--steps", type=int, default=30, help="denoising steps, with --checkpoint (the tiny pipeline runs 2)")
p.add_argument("--out", default="generated.gif", help="the GIF rank 0 writes (default: ./generated.gif)")
args = p.parse_args()
if args.checkpoint:  # every rank loads the same pipeline
    # diffusers that deprecate torch_dtype= read dtype=; older ones read only torch_dtype= (they would load fp32)
    import diffusers.utils.deprecation_utils as dep
    key = "dtype" if hasattr(dep, "_resolve_dtype") else "torch_dtype"
    pipe = DiffusionPipeline.from_pretrained(args.checkpoint, **{key: torch.bfloat16})
    call = dict(prompt=args.prompt, num_inference_steps=args.steps)
else:  # no checkpoint: a tiny two-transformer pipeline with random weights, built here (no download)
    pipe, call = tiny_wan22()
    if os.environ.get("RANK", "0") == "0":
        print("no --checkpoint: a tiny random Wan 2.2-style pipeline, its own prompt and 2 steps"
              + (" (--prompt/--steps are used with --checkpoint only)" if {"--prompt", "--steps"} & set(sys.argv) else ""))
pipe = parallelize_pipeline(pipe)  # every transformer, on cuda:LOCAL_RANK (CPU without CUDA)
out = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="pil")  # the same seed on every rank
if pipe.cp_ops_writes_output:  # rank 0 writes
    export_to_gif(out.frames[0] if hasattr(out, "frames") else out.images, args.out)
    print(f"wrote {args.out} ({len(pipe.cp_ops_transformers)} transformers under CP)")
torch.distributed.destroy_process_group()
