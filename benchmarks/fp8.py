"""FP8 communication on ONE device: its accuracy cost (emulated, exact) and its kernels' cost (docs/fp8.md).

    python benchmarks/fp8.py --out DIR [--sections kernels,micro,models] [--models flux,zimage,wan] [--steps N]

* ``kernels`` — µs of the codec (cp_ops.kernels.fp8: Triton on CUDA, torch elsewhere) per tensor ``[1, S_local, H,
  128]`` bf16, beside the link time the FP8 bytes save at ``--link-gbs`` GB/s per peer (NVLink H200 ~345): a
  Ulysses all-to-all of one tensor over W ranks moves ``(W-1)/W`` of it over W-1 links at once (time ≈ bytes/W per
  link); an AGKV gather receives one block per peer (time ≈ the block per link). It pays where
  encode + decode < saved link time (and only for exposed transfers: a pipelined one hides under attention anyway).
* ``fused`` — the FP8 codec fused with the Ulysses pack/unpack (cp_ops.kernels.fp8_ulysses) against the unfused
  path (contiguous encode + torch pack; decode + unpack) and the contiguous encode alone: µs and GB/s per (tokens,
  W), the first call's seconds and the compiled variants (CUDA; prints a table).
* ``codec`` — the Triton kernels against the torch version on the self-test's inputs (CUDA): bytes that differ,
  payload and scale apart, and whether each one's scales are the IEEE quotients amax / fp8_max (docs/fp8.md).
* ``micro`` — relative error of one attention call on random bf16 ``[1, S, H, 128]`` per tensor choice (every
  non-empty subset of q/k/v/o for Ulysses, k+v for AGKV), e4m3 and e5m2, against bf16 (max-abs relative and RMS).
* ``models`` — the full-size models of ``cp-ops run`` (random weights, the default GPU resolution; ``tiny`` on
  CPU), parallelized over a group of ONE rank with ``CP_OPS_EMULATE_COMM=1`` (cp_ops.emulate: every tensor that W
  ranks would send goes through the codec exactly as the transport does; the W-rank result at chunks = 1 for any
  W): relative error of one forward and of the final latents after ``--steps`` scheduler steps, against bf16
  communication (the same group of one, comm_dtype None) and against one GPU (the unparallelized model).
  ``rel_max`` = max|x - ref| / max|ref|, ``rel_rms`` = ||x - ref|| / ||ref||.
* ``vae`` — one image model (``--models flux``, or ``zimage``) at full size, random weights, ``--steps`` steps from
  the same noise, its final latents decoded through a full-size FLUX.1 VAE (``AutoencoderKL``, 16 latent channels,
  random weights, seeded; the VAE Flux and Z-Image ship) in the model's dtype, as the pipelines decode: per
  communication variant — the mode ``mode='auto'`` picks at W = 2, 4, 8 for the model's head count (the emulation is
  the same for every W of one mode: per-(token, head) scales), e5m2, and a 2-D mesh (a 1x1 mesh with the emulation:
  K and V cross two links, each through the codec) — the pixel-space PSNR of the image in [0, 1] (peak 1) and the
  relative error of the raw decoder output, against bf16 communication (the same group of one, comm_dtype None,
  which equals one GPU bitwise; checked in the row ``bf16 comm``). For scale (CUDA): one GPU with another bf16 SDPA
  kernel (flash instead of cuDNN), no FP8.

Writes ``DIR/fp8_<section>.json`` (one list of rows each) and prints one line per row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
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


def _variants(fn) -> int:
    """Compiled variants a Triton kernel holds (every device), or -1 where this Triton keeps them elsewhere."""
    try:
        return sum(len(c[0]) for c in fn.device_caches.values())
    except Exception:  # noqa: BLE001 - another Triton version's internals
        return -1


def fused(device, args) -> list[dict]:
    """The FP8 codec fused with the Ulysses pack/unpack (cp_ops.kernels.fp8_ulysses) against today's unfused path,
    per (tokens, W): B = 1, q/k/v bf16 ``[1, S_local, H, 128]``, e4m3, µs (median of 21 samples of 5 calls, CUDA
    events, after 3 warm-up calls) and GB/s (bytes read + written). Send: (a) unfused = the contiguous encode of each
    tensor + the torch pack (``layout.ulysses_pack``), (b) fused = ``pack_encode``. Receive (the send buffer stands in
    for the received one: same shape): (a) decode + ``layout.ulysses_unpack_all`` (views at B = 1), (b)
    ``unpack_decode`` (contiguous [3, B, W*S, Hl, D]). Inverse receive ``[W, 1, S, Hl, D + 4]``: (a) decode +
    ``layout.ulysses_inverse_unpack``, (b) ``inverse_decode``. Reference: the contiguous encode of one tensor
    (``fp8.encode``). Also: the first call's seconds (compile included: run it with a fresh TRITON_CACHE_DIR) and the
    compiled variants of each kernel after the sweep. Prints a table."""
    from cp_ops import layout, timing
    from cp_ops.kernels import fp8, fp8_ulysses as fu

    if not fp8.use_triton(device):
        return [{"skipped": "needs CUDA and the Triton codec (fp8.use_triton)"}]
    f, d, n = "e4m3", 128, 3
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _d: None)

    def us(fn):
        return statistics.median(timing.steady_ms(fn, device, warmup=3, samples=21, calls=5)) * 1e3

    configs = [tuple(int(v) for v in c.split("x")) for c in args.fused_configs.split(",")]
    rows = []
    first = {}
    for (total, h), w in itertools.product(configs, (2, 4, 8)):
        if h % w or total % w:
            continue
        s, hl = total // w, h // w
        g = torch.Generator(device=device).manual_seed(total + w)
        xs = [torch.randn(1, s, h, d, generator=g, device=device, dtype=torch.bfloat16) for _ in range(n)]
        o = torch.randn(1, w * s, hl, d, generator=g, device=device, dtype=torch.bfloat16)
        if not first:  # the first calls: the JIT compiles (fresh cache) included
            for name, fn in (("pack_encode", lambda: fu.pack_encode(xs, w, 0, None, f)),
                             ("unpack_decode", lambda: fu.unpack_decode(fu.pack_encode(xs, w, 0, None, f),
                                                                        torch.bfloat16, f)),
                             ("inverse_decode", lambda: fu.inverse_decode(
                                 layout.ulysses_inverse_pack(fp8.encode(o, f), w), torch.bfloat16, f))):
                sync(device)
                t = time.perf_counter()
                fn()
                sync(device)
                first[name] = round(time.perf_counter() - t, 2)
        send = fu.pack_encode(xs, w, 0, None, f)
        unfused_send = layout.ulysses_pack([fp8.encode(x, f) for x in xs], w)
        assert torch.equal(send, unfused_send), (total, w)  # bitwise, as the tests check
        back = layout.ulysses_inverse_pack(fp8.encode(o, f), w)
        u = fu.unpack_decode(send, torch.bfloat16, f)
        assert torch.equal(u, torch.stack(layout.ulysses_unpack_all(fp8.decode(send, torch.bfloat16, f))))
        v = fu.inverse_decode(back, torch.bfloat16, f)
        assert torch.equal(v.view(1, s, h, d), layout.ulysses_inverse_unpack(fp8.decode(back, torch.bfloat16, f)))
        rows_n = n * s * h  # encoded rows of the send (and receive) buffer
        io_enc = rows_n * (2 * d + d + 4)  # bf16 read + encoded written
        io_inv = s * h * (d + 4 + 2 * d)
        row = dict(tokens=total, world=w, s_local=s, heads=h, head_dim=d, fmt=f, send_bytes=send.numel())
        row["send_unfused_us"] = us(lambda: layout.ulysses_pack([fp8.encode(x, f) for x in xs], w))
        row["send_fused_us"] = us(lambda: fu.pack_encode(xs, w, 0, None, f))
        row["recv_unfused_us"] = us(lambda: layout.ulysses_unpack_all(fp8.decode(send, torch.bfloat16, f)))
        row["recv_fused_us"] = us(lambda: fu.unpack_decode(send, torch.bfloat16, f))
        row["inv_unfused_us"] = us(lambda: layout.ulysses_inverse_unpack(fp8.decode(back, torch.bfloat16, f)))
        row["inv_fused_us"] = us(lambda: fu.inverse_decode(back, torch.bfloat16, f))
        row["encode_one_us"] = us(lambda: fp8.encode(xs[0], f))
        for k in ("send_unfused", "send_fused", "recv_unfused", "recv_fused"):
            row[k + "_gbs"] = round(io_enc / row[k + "_us"] / 1e3, 1)
        for k in ("inv_unfused", "inv_fused"):
            row[k + "_gbs"] = round(io_inv / row[k + "_us"] / 1e3, 1)
        row["encode_one_gbs"] = round(io_enc / n / row["encode_one_us"] / 1e3, 1)
        rows.append(row)
        del xs, o, send, unfused_send, back, u, v
    var = {name: _variants(k) for name, k in (("pack_encode", getattr(fu, "_pack_encode_kernel", None)),
                                              ("unpack_decode", getattr(fu, "_unpack_decode_kernel", None)),
                                              ("encode", getattr(fp8, "_encode_kernel", None)),
                                              ("decode", getattr(fp8, "_decode_kernel", None)))}
    print("fused FP8 Ulysses codec, e4m3, bf16, D = 128, B = 1; µs (GB/s, bytes read + written); send/recv: q, k, v")
    print("| tokens x heads | W | send unfused | send fused | recv unfused | recv fused | inverse recv unfused | "
          "inverse recv fused | encode one tensor (contiguous) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = lambda k: f"{r[k + '_us']:.1f} ({r[k + '_gbs']:.0f})"  # noqa: E731
        print(f"| {r['tokens']} x {r['heads']} | {r['world']} | {c('send_unfused')} | {c('send_fused')} | "
              f"{c('recv_unfused')} | {c('recv_fused')} | {c('inv_unfused')} | {c('inv_fused')} | {c('encode_one')} |")
    print(f"first call, s (compile included with a fresh cache): {first}; compiled variants after the sweep: {var}",
          flush=True)
    rows.append(dict(first_call_s=first, variants=var))
    return rows


def codec(device, args) -> list[dict]:
    from cp_ops.kernels import fp8

    if device.type != "cuda" or fp8.triton is None:
        return [{"skipped": "needs CUDA and Triton"}]
    g = torch.Generator(device=device).manual_seed(0)
    sweep = torch.linspace(-1, 1, 255, device=device).repeat(8, 1) * torch.logspace(-6, 4, 8, device=device)[:, None]
    x = torch.cat([sweep[:, :128], sweep[:, 127:], torch.randn(64, 128, generator=g, device=device) * 4])
    rows = []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        xd = x.to(dt)
        amax = xd.float().abs().amax(-1).double()
        for fmt, (_, fmax) in fp8.FORMATS.items():
            tri, tor = fp8.encode_triton(xd, fmt), fp8.encode_torch(xd, fmt)
            ieee = (amax / fmax).float()
            sc = lambda e: e[:, -4:].contiguous().view(torch.float32)[:, 0]  # noqa: E731
            row = dict(dtype=str(dt).replace("torch.", ""), fmt=fmt, rows=x.shape[0],
                       payload_bytes_differ=int((tri[:, :-4] != tor[:, :-4]).sum()),
                       scale_bytes_differ=int((tri[:, -4:] != tor[:, -4:]).sum()),
                       triton_scales_ieee=bool(torch.equal(sc(tri), ieee)),
                       torch_scales_ieee=bool(torch.equal(sc(tor), ieee)),
                       decode_equal=bool(torch.equal(fp8.decode_triton(tor, dt, fmt), fp8.decode_torch(tor, dt, fmt))))
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
#: ``--variants`` short names → rows of VARIANTS ("ulysses k,v e4m3" equals "agkv k,v e4m3" in the emulation)
SHORT = {"agkv": 0, "e4m3": 1, "cachedit": 2, "kv": 3, "e5m2": 4}


def _group_of_one(device) -> None:
    """A process group of one rank (the models run parallelized over it; the emulation round-trips what would cross)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)


def _model(name: str, conf: str, args, device):
    """``(spec, conf, cfg, model, inputs, (frames, height, width), build seconds)``: the model ``name`` at ``conf``
    (default: full size on CUDA, tiny on CPU), bf16, seeded inputs, cuDNN attention on CUDA."""
    from cp_ops.cli.models import MODELS, build

    gpu = device.type == "cuda"
    spec = MODELS[name]
    conf = conf or (spec.gpu_config if gpu else "tiny")
    t0 = time.perf_counter()
    model, cfg = build(spec, conf, args.layers, device, torch.bfloat16)
    f, hh, ww = spec.gpu_latent if gpu else spec.cpu_latent
    g = torch.Generator(device=device).manual_seed(42)
    kw = spec.make_inputs(cfg, spec.text_tokens[conf], 1, f, hh, ww, device, torch.bfloat16, g)
    if gpu:
        model.set_attention_backend("_native_cudnn")
    return spec, conf, cfg, model, kw, (f, hh, ww), time.perf_counter() - t0


def _emit(args, row) -> None:
    """Print a row and append it to ``DIR/fp8_models.jsonl`` at once (a run cut by its time limit keeps its rows)."""
    print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "fp8_models.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def models(device, args) -> list[dict]:
    import torch.distributed as dist

    from cp_ops import comm_dtype as cd
    from cp_ops import config
    from cp_ops.cli.run import denoise
    from cp_ops.integrations.diffusers import parallelize

    _group_of_one(device)
    rows, gpu = [], device.type == "cuda"
    if args.codec == "torch":  # the torch version of the codec (bitwise the Triton one: its self-test) — no kernel
        from cp_ops.kernels import fp8  # compiles in the model's first forwards (2026-12-01g: they did not finish)

        fp8._checked[device.index if device.index is not None else torch.cuda.current_device() if gpu else None] = False
    for name in args.models.split(","):
        name, _, conf = name.partition(":")
        spec, conf, cfg, model, kw, (f, hh, ww), build_s = _model(name, conf, args, device)
        with torch.no_grad():
            one = spec.predict(model, kw).float()
        one_lat, _ = denoise(model, spec, kw, args.steps, device)
        parallelize(model, group=dist.group.WORLD, mode="agkv", cuda_graphs=False)
        state = model._cp_ops_state
        base = dict(model=name, config=conf, tokens=spec.tokens(cfg, f, hh, ww), steps=args.steps,
                    build_s=round(build_s, 1))
        if args.bf16_check:
            with torch.no_grad():
                bf = spec.predict(model, kw).float()
            bf_lat, _ = denoise(model, spec, kw, args.steps, device)
            row = dict(base, variant="bf16 comm (group of 1)", fwd_vs_1gpu=_rel(bf, one),
                       lat_vs_1gpu=_rel(bf_lat, one_lat))
            rows.append(row)
            _emit(args, row)
        else:  # a group of one without FP8 runs the unparallelized attention: bitwise one GPU (checked on every
            bf, bf_lat = one, one_lat  # model of the 2026-12-01 run and by the rows here that check it)
        config.configure(emulate_comm=True)
        variants = [VARIANTS[SHORT[v]] for v in args.variants.split(",")] if args.variants else VARIANTS
        try:
            for vname, mode, c in variants:
                t0 = time.perf_counter()
                state.mode, state.comm_dtype = mode, cd.normalize(c)
                with torch.no_grad():
                    out = spec.predict(model, kw).float()
                lat, _ = denoise(model, spec, kw, args.steps, device)
                row = dict(base, variant=vname, mode=mode, fwd_vs_bf16=_rel(out, bf), fwd_vs_1gpu=_rel(out, one),
                           lat_vs_bf16=_rel(lat, bf_lat), lat_vs_1gpu=_rel(lat, one_lat),
                           bf16_comm="measured" if args.bf16_check else "= 1 GPU (not re-run)",
                           seconds=round(time.perf_counter() - t0, 1))
                rows.append(row)
                _emit(args, row)
        finally:
            config.configure(emulate_comm=False)
            state.comm_dtype = None
        del model, kw, one, bf, one_lat, bf_lat
        if gpu:
            torch.cuda.empty_cache()
    return rows


def _vae(device, dtype, latent_channels: int = 16):
    """A full-size FLUX.1 VAE (the one Flux.1 and Z-Image ship: diffusers ``AutoencoderKL``, 16 latent channels, 8x
    spatial), random weights from a fixed seed (``latent_channels``: fewer for the CPU's tiny models)."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                            block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32, scaling_factor=0.3611,
                            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    return vae.to(device=device, dtype=dtype).eval()


def _to_image_latents(name: str, lat: torch.Tensor, hh: int, ww: int) -> torch.Tensor:
    """The model's final latents as the VAE's ``[B, 16, H/8, W/8]`` (Flux: unpack the 2x2 patches, as
    ``FluxPipeline._unpack_latents``; Z-Image: drop the frame dim)."""
    if name == "flux":
        b, n, c = lat.shape
        return lat.view(b, hh // 2, ww // 2, c // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c // 4, hh, ww)
    return lat[:, :, 0]


def _psnr(img: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR in dB of two images in [0, 1] (peak 1); inf when equal."""
    mse = (img.float() - ref.float()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()


def vae(device, args) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cp_ops import comm_dtype as cd
    from cp_ops import choose_mode, config
    from cp_ops.cli.run import denoise
    from cp_ops.integrations.diffusers import parallelize

    _group_of_one(device)
    gpu = device.type == "cuda"
    name = args.models.split(",")[0]
    spec, conf, cfg, model, kw, (f, hh, ww), build_s = _model(name, "", args, device)
    dec = _vae(device, torch.bfloat16, cfg["in_channels"] // (4 if name == "flux" else 1))

    def decode(lat):
        z = _to_image_latents(name, lat, hh, ww).to(torch.bfloat16)
        with torch.no_grad():
            x = dec.decode(z / dec.config.scaling_factor + dec.config.shift_factor).sample.float()
        return x, (x / 2 + 0.5).clamp(0, 1)

    one_raw, one_img = decode(denoise(model, spec, kw, args.steps, device)[0])
    floor = None
    if gpu:  # a scale for the rows: another bf16 SDPA kernel (flash instead of cuDNN), no FP8, one GPU
        model.set_attention_backend("_native_flash")
        fl_raw, fl_img = decode(denoise(model, spec, kw, args.steps, device)[0])
        floor = dict(psnr_db=_psnr(fl_img, one_img), **_rel(fl_raw, one_raw))
        model.set_attention_backend("_native_cudnn")
    parallelize(model, group=dist.group.WORLD, mode="agkv", cuda_graphs=False)
    state = model._cp_ops_state
    bf_raw, bf_img = decode(denoise(model, spec, kw, args.steps, device)[0])
    heads = cfg[spec.heads_key]
    base = dict(model=name, config=conf, tokens=spec.tokens(cfg, f, hh, ww), heads=heads, steps=args.steps,
                image=list(one_img.shape[-2:]), build_s=round(build_s, 1),
                image_std=one_img.std().item())
    rows = [dict(base, variant="bf16 comm (group of 1) vs 1 GPU", psnr_db=_psnr(bf_img, one_img),
                 **_rel(bf_raw, one_raw))]
    if floor is not None:
        rows.append(dict(base, variant="scale: 1 GPU, SDPA flash vs cuDNN (no FP8)", **floor))
    for r in rows:
        print(json.dumps(r), flush=True)
    picks = {}  # mode 'auto' at each W for this head count -> the Ws
    for w in (2, 4, 8):
        picks.setdefault(choose_mode("auto", heads, w), []).append(w)
    variants = [(f"W={'/'.join(map(str, ws))}: mode auto = {m}, e4m3", m, E4, None) for m, ws in picks.items()]
    variants += [("ulysses q,k,v,o e5m2", "ulysses", E5, None),
                 ("2-D mesh (e.g. 2x4): q,o e4m3 once, k,v e4m3 twice", "auto", E4, "mesh")]
    config.configure(emulate_comm=True)
    try:
        for vname, mode, c, group in variants:
            t = time.perf_counter()
            state.mode, state.comm_dtype = mode, cd.normalize(c)
            pg = state.attn_group
            if group == "mesh":
                state.attn_group = init_device_mesh(device.type, (1, 1), mesh_dim_names=("agkv", "ulysses"))
            try:
                raw, img = decode(denoise(model, spec, kw, args.steps, device)[0])
            finally:
                state.attn_group = pg
            row = dict(base, variant=vname, mode=mode, psnr_db=_psnr(img, bf_img), **_rel(raw, bf_raw),
                       psnr_vs_1gpu_db=_psnr(img, one_img), seconds=round(time.perf_counter() - t, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        config.configure(emulate_comm=False)
        state.comm_dtype = None
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sections", default="kernels,micro,models")
    p.add_argument("--models", default="flux,zimage,wan")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--link-gbs", type=float, default=345.0)
    p.add_argument("--fused-configs", default="4096x24,8192x24,32760x12,75600x40",
                   help="fused: TOKENSxHEADS,... (W = 2, 4, 8 where they divide both)")
    p.add_argument("--variants", default="", help="models: comma-separated subset of " + ",".join(SHORT) +
                   " (default: all)")
    p.add_argument("--codec", choices=("torch", "auto"), default="torch",
                   help="models: the codec version the emulation runs (torch: bitwise the Triton kernels, no JIT "
                        "compiles; auto: Triton on CUDA after its self-test)")
    p.add_argument("--no-bf16-check", dest="bf16_check", action="store_false",
                   help="models: do not re-run bf16 communication on the group of one (it equals one GPU, bitwise)")
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
