"""What parallelize's default (the whole forward captured in one CUDA graph) costs in GPU memory, full size.

For each model (full depth, random weights, bf16, its standard resolution: ``cp_ops.cli.models``) on a real one-rank
NCCL group: the same model parallelized with ``cuda_graphs=False`` (eager) and with the default; each runs
``--calls`` forwards on one input. Reported per path: the peak allocated during the forwards, the memory the caching
allocator keeps reserved after them and ``empty_cache()`` (a captured graph keeps its private pool: about one forward's
activations), and
the median ms per forward (CUDA events; a one-rank group: no communication, so this is the host's share, not CP).
Both paths' outputs are compared (bitwise: the same kernels on the same data).

    python benchmarks/capture_memory.py --models wan,flux,qwenimage --out capture_memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics

import torch
import torch.distributed as dist


def _run(model, kw, spec, calls: int) -> tuple[dict, torch.Tensor]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times, out = [], None
    with torch.no_grad():
        for _ in range(calls):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = spec.predict(model, kw)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    out = out.clone()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # eager's activations go back; a captured graph's private pool stays
    return {"peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
            "kept_reserved_gib": torch.cuda.memory_reserved() / 2**30,
            "kept_allocated_gib": (torch.cuda.memory_allocated() - base) / 2**30,
            "ms_median_after_first": statistics.median(times[1:]), "first_ms": times[0]}, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="wan,flux,qwenimage", help="comma list of cp_ops.cli.models names")
    ap.add_argument("--calls", type=int, default=6, help="forwards per path (the first captures)")
    ap.add_argument("--out", default="capture_memory.json")
    args = ap.parse_args()

    from cp_ops.cli.models import MODELS, build
    from cp_ops.integrations.diffusers import parallelize

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    dev, dtype = torch.device("cuda:0"), torch.bfloat16
    rows = []
    for name in args.models.split(","):
        spec = MODELS[name]
        base, cfg = build(spec, spec.gpu_config, None, dev, dtype)  # seed 0: each build has the same weights
        f, h, w = spec.gpu_latent
        gen = torch.Generator(device=dev).manual_seed(5)
        kw = spec.make_inputs(cfg, spec.text_tokens[spec.gpu_config], 1, f, h, w, dev, dtype, gen)
        row = {"model": name, "config": spec.gpu_config, "latent": [f, h, w],
               "tokens": spec.tokens(cfg, f, h, w), "weights_gib": sum(p.numel() * p.element_size()
                                                                    for p in base.parameters()) / 2**30}
        outs = {}
        for path, graphs in (("eager", {"cuda_graphs": False}), ("default", {})):
            # one copy of the model at a time (a 20B model's two copies would not fit 80 GB)
            model = parallelize(base if base is not None else build(spec, spec.gpu_config, None, dev, dtype)[0],
                                **graphs)
            base = None
            row[path], outs[path] = _run(model, kw, spec, args.calls)
            outs[path] = outs[path].cpu()
            del model
            gc.collect()
            torch.cuda.empty_cache()
        row["captured_extra_reserved_gib"] = row["default"]["kept_reserved_gib"] - row["eager"]["kept_reserved_gib"]
        row["bitwise_equal"] = bool(torch.equal(outs["eager"], outs["default"]))
        print(json.dumps(row), flush=True)
        rows.append(row)
        del base, outs
        gc.collect()
        torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
