"""FP8 communication on ONE device: its accuracy cost (emulated, exact) and its kernels' cost (docs/fp8.md).

    python benchmarks/fp8.py --out DIR [--sections kernels,micro,models] [--models flux,zimage,wan] [--steps N]

* ``kernels`` — µs of the codec (cp_ops.kernels.fp8: Triton on CUDA, torch elsewhere) per tensor ``[1, S_local, H,
  128]`` bf16, beside the link time the FP8 bytes save at ``--link-gbs`` GB/s per peer (NVLink H200 ~345): a
  Ulysses all-to-all of one tensor over W ranks moves ``(W-1)/W`` of it over W-1 links at once (time ≈ bytes/W per
  link); an AGKV gather receives one block per peer (time ≈ the block per link). It pays where
  encode + decode < saved link time (and only for exposed transfers: a pipelined one hides under attention anyway).
* ``micro`` — relative error of one attention call on random bf16 ``[1, S, H, 128]`` per tensor choice (every
  non-empty subset of q/k/v/o for Ulysses, k+v for AGKV), e4m3 and e5m2, against bf16 (max-abs relative and RMS).
* ``models`` — the full-size models of ``cp-ops run`` (random weights, the default GPU resolution; ``tiny`` on
  CPU), parallelized over a group of ONE rank with ``CP_OPS_EMULATE_COMM=1`` (cp_ops.emulate: every tensor that W
  ranks would send goes through the codec exactly as the transport does; the W-rank result at chunks = 1 for any
  W): relative error of one forward and of the final latents after ``--steps`` scheduler steps, against bf16
  communication (the same group of one, comm_dtype None) and against one GPU (the unparallelized model).
  ``rel_max`` = max|x - ref| / max|ref|, ``rel_rms`` = ||x - ref|| / ||ref||.

Writes ``DIR/fp8_<section>.json`` (one list of rows each) and prints one line per row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _rel(x, ref) -> dict:
    x, ref = x.float(), ref.float()
    d = x - ref
    return {"rel_max": (d.abs().max() / ref.abs().max()).item(), "rel_rms": (d.norm() / ref.norm()).item()}


def _time_us(fn, device, n=50) -> float:
    """µs per call: one sample of ``n`` back-to-back calls between CUDA events after one warm-up call
    (:func:`cp_ops.timing.steady_ms`); 3 calls on CPU."""
    from cp_ops import timing

    return timing.steady_ms(fn, device, warmup=1, samples=1, calls=n if device.type == "cuda" else 3)[0] * 1e3


def kernels(device, args) -> list[dict]:
    from cp_ops.kernels import fp8

    rows = []
    h, d = 24, 128
    totals = [4096, 16384, 32768, 75600] if device.type == "cuda" else [256]
    for total, w in itertools.product(totals, (2, 4, 8)):
        s = total // w
        x = torch.randn(1, s, h, d, device=device, dtype=torch.bfloat16)
        enc = fp8.encode(x, "e4m3")
        row = dict(tokens=total, world=w, s_local=s, heads=h, head_dim=d, bytes_bf16=x.numel() * 2,
                   bytes_fp8=enc.numel(), kernel="triton" if fp8.use_triton(device) else "torch")
        row["encode_us"] = _time_us(lambda: fp8.encode(x, "e4m3"), device)
        row["decode_us"] = _time_us(lambda: fp8.decode(enc, torch.bfloat16, "e4m3"), device)
        if device.type == "cuda":
            row["encode_torch_us"] = _time_us(lambda: fp8.encode_torch(x, "e4m3"), device)
            row["decode_torch_us"] = _time_us(lambda: fp8.decode_torch(enc, torch.bfloat16, "e4m3"), device)
        saved = row["bytes_bf16"] - row["bytes_fp8"]  # one local shard
        link = args.link_gbs * 1e3  # bytes per µs
        # Ulysses, per tensor: W-1 blocks of size shard/W leave over W-1 links at once; W-1 arrive (decode them all)
        row["ulysses_saved_link_us"] = saved / w / link
        row["ulysses_codec_us"] = row["encode_us"] + row["decode_us"] * (w - 1) / w
        # AGKV, per tensor: the shard goes to every peer (one link each, at once); W-1 shards arrive
        row["agkv_saved_link_us"] = saved / link
        row["agkv_codec_us"] = row["encode_us"] + row["decode_us"] * (w - 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def micro(device, args) -> list[dict]:
    from cp_ops import comm_dtype as cd
    from cp_ops import emulate
    from cp_ops.kernels import local_attention

    rows = []
    shapes = [(4096, 24), (32768, 12)] if device.type == "cuda" else [(256, 4)]
    for (s, h), seed in zip(shapes, itertools.count()):
        g = torch.Generator(device=device).manual_seed(seed)
        q, k, v = (torch.randn(1, s, h, 128, generator=g, device=device, dtype=torch.bfloat16) for _ in range(3))
        ref = local_attention(q, k, v)
        for fmt in ("e4m3", "e5m2"):
            subsets = [c for n in range(1, 5) for c in itertools.combinations("qkvo", n)]
            for sub in subsets:
                fmts = tuple(fmt if n in sub else "" for n in cd.NAMES)
                out = emulate.attention(q, k, v, None, None, fmts)
                modes = ["ulysses"] + (["agkv"] if set(sub) == {"k", "v"} else [])
                row = dict(tokens=s, heads=h, fmt=fmt, tensors="".join(sub), modes=modes, **_rel(out, ref))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


VARIANTS = [  # (name, mode, comm_dtype)
    ("agkv k,v e4m3", "agkv", E4),
    ("ulysses q,k,v,o e4m3", "ulysses", E4),
    ("ulysses q,v,o e4m3 (cache-dit)", "ulysses", {"q": E4, "v": E4, "o": E4}),
    ("ulysses k,v e4m3", "ulysses", {"k": E4, "v": E4}),
    ("ulysses q,k,v,o e5m2", "ulysses", E5),
]


def models(device, args) -> list[dict]:
    import torch.distributed as dist

    from cp_ops import comm_dtype as cd
    from cp_ops import config
    from cp_ops.cli.models import MODELS, build
    from cp_ops.cli.run import denoise
    from cp_ops.integrations.diffusers import parallelize

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    rows = []
    gpu = device.type == "cuda"
    for name in args.models.split(","):
        name, _, conf = name.partition(":")
        spec = MODELS[name]
        conf = conf or (spec.gpu_config if gpu else "tiny")
        t0 = time.perf_counter()
        model, cfg = build(spec, conf, args.layers, device, torch.bfloat16)
        f, hh, ww = spec.gpu_latent if gpu else spec.cpu_latent
        g = torch.Generator(device=device).manual_seed(42)
        kw = spec.make_inputs(cfg, spec.text_tokens[conf], 1, f, hh, ww, device, torch.bfloat16, g)
        if gpu:
            model.set_attention_backend("_native_cudnn")
        with torch.no_grad():
            one = spec.predict(model, kw).float()
        one_lat, _ = denoise(model, spec, kw, args.steps, device)
        parallelize(model, group=dist.group.WORLD, mode="agkv")
        state = model._cp_ops_state
        with torch.no_grad():
            bf = spec.predict(model, kw).float()
        bf_lat, _ = denoise(model, spec, kw, args.steps, device)
        base = dict(model=name, config=conf, tokens=spec.tokens(cfg, f, hh, ww), steps=args.steps,
                    build_s=round(time.perf_counter() - t0, 1))
        row = dict(base, variant="bf16 comm (group of 1)", fwd_vs_1gpu=_rel(bf, one), lat_vs_1gpu=_rel(bf_lat, one_lat))
        rows.append(row)
        print(json.dumps(row), flush=True)
        config.configure(emulate_comm=True)
        try:
            for vname, mode, c in VARIANTS:
                state.mode, state.comm_dtype = mode, cd.normalize(c)
                with torch.no_grad():
                    out = spec.predict(model, kw).float()
                lat, _ = denoise(model, spec, kw, args.steps, device)
                row = dict(base, variant=vname, mode=mode, fwd_vs_bf16=_rel(out, bf), fwd_vs_1gpu=_rel(out, one),
                           lat_vs_bf16=_rel(lat, bf_lat), lat_vs_1gpu=_rel(lat, one_lat))
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            config.configure(emulate_comm=False)
            state.comm_dtype = None
        del model, kw, one, bf, one_lat, bf_lat
        if gpu:
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sections", default="kernels,micro,models")
    p.add_argument("--models", default="flux,zimage,wan")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--link-gbs", type=float, default=345.0)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.out, exist_ok=True)
    status = 0
    for sec in args.sections.split(","):
        t = time.perf_counter()
        try:
            rows = globals()[sec](device, args)
        except Exception as e:  # noqa: BLE001 - one failed section still leaves the others
            import traceback

            traceback.print_exc()
            rows, status = [{"error": f"{type(e).__name__}: {e}"}], 1
        with open(os.path.join(args.out, f"fp8_{sec}.json"), "w") as f:
            json.dump(dict(section=sec, seconds=round(time.perf_counter() - t, 1), torch=torch.__version__,
                           device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", rows=rows), f,
                      indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
