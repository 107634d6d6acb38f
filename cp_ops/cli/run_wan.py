"""``cp-ops run wan``: one forward pass of a real diffusers Wan transformer, single rank vs CP over W ranks.

The Wan architecture with random seeded weights (no checkpoint download): the output says so. The single-rank baseline is the unmodified diffusers
model on rank 0 (attention backend cuDNN on CUDA, the same kernel the CP attention uses); then the same
model is parallelized in place with :func:`cp_ops.integrations.diffusers.parallelize` and run on all
ranks. Prints CP time, single-rank time, speedup and max relative error (max |cp − ref| / max |ref|).
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from .bench import DTYPES, _write_json, available_cores, environment
from .timing import max_over_ranks, time_ms

# Wan2.1-T2V-1.3B and -14B transformer configs (diffusers WanTransformer3DModel arguments); "tiny" is
# the CPU default, same structure, minutes → seconds.
CONFIGS = {
    "1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, text_dim=4096,
                 freq_dim=256, in_channels=16, out_channels=16, patch_size=(1, 2, 2)),
    "14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, text_dim=4096,
                freq_dim=256, in_channels=16, out_channels=16, patch_size=(1, 2, 2)),
    "tiny": dict(num_attention_heads=4, attention_head_dim=16, ffn_dim=128, num_layers=2, text_dim=32,
                 freq_dim=32, in_channels=4, out_channels=4, patch_size=(1, 2, 2)),
}
TEXT_TOKENS = {"1.3b": 512, "14b": 512, "tiny": 16}


def build(config: str, layers: int | None, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from diffusers import WanTransformer3DModel

    cfg = dict(CONFIGS[config])
    if layers is not None:
        cfg["num_layers"] = layers
    torch.manual_seed(seed)
    with torch.device(device):
        model = WanTransformer3DModel(**cfg)
    # Cast as from_pretrained(torch_dtype=...) does: modules the class keeps in fp32 stay fp32, and RoPE
    # tables (fp64 buffers) stay untouched.
    keep = tuple(model._keep_in_fp32_modules or ())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.dtype == torch.float32 and not any(k in name.split(".") for k in keep):
            t.data = t.data.to(dtype)
    return model.eval(), cfg


def _compile(model, args):
    import cp_ops

    return cp_ops.compile(model, fullgraph=True, overlap=not args.no_overlap)


def run_wan(rank: int, world_size: int, device: torch.device, args) -> None:
    """Rank body of ``cp-ops run wan`` (arguments validated by :mod:`cp_ops.cli.main` before the ranks start)."""
    from cp_ops import choose_mode, select_transport
    from cp_ops.integrations.diffusers import parallelize

    if device.type == "cpu":
        torch.set_num_threads(max(1, available_cores() // world_size))
    dtype = DTYPES[args.dtype]
    model, cfg = build(args.config, args.layers, device, dtype)
    pt, ph, pw = cfg["patch_size"]
    tokens = (args.frames // pt) * (args.height // ph) * (args.width // pw)
    mode = choose_mode(args.mode, cfg["num_attention_heads"], world_size)
    transport = select_transport(args.transport, device.type)
    g = torch.Generator(device=device).manual_seed(42)
    x = torch.randn(args.batch, cfg["in_channels"], args.frames, args.height, args.width, generator=g,
                    device=device, dtype=dtype)
    text = torch.randn(args.batch, TEXT_TOKENS[args.config], cfg["text_dim"], generator=g, device=device, dtype=dtype)
    t = torch.full((args.batch,), 500, device=device, dtype=torch.long)
    if device.type == "cuda":
        model.set_attention_backend("_native_cudnn")

    def fwd(m):
        with torch.no_grad():
            return m(x, t, text, return_dict=False)[0]

    single_ms, ref = 0.0, None
    if rank == 0 and args.compile:
        print("compiling the single-rank model (first call; tens of seconds) ...", flush=True)
    if rank == 0:
        m = _compile(model, args) if args.compile else model
        single_ms = time_ms(lambda: fwd(m), device, args.warmup, args.repeats)
        ref = fwd(m).float()
    dist.barrier()
    if args.compile:
        torch._dynamo.reset()
    parallelize(model, mode=args.mode, transport=args.transport)
    if rank == 0 and args.compile:
        print(f"compiling the CP{world_size} model ...", flush=True)
    m = _compile(model, args) if args.compile else model
    cp_ms = max_over_ranks(time_ms(lambda: fwd(m), device, args.warmup, args.repeats), device)
    out = fwd(m).float()
    error = None
    if rank == 0:
        try:
            report(args, cfg, device, world_size, tokens, mode, transport, cp_ms, single_ms, out, ref)
        except Exception as e:  # noqa: BLE001 - surface rank 0's error, not a peer's lost connection
            error = e
    dist.barrier()
    if error is not None:
        raise error


def report(args, cfg, device, world_size, tokens, mode, transport, cp_ms, single_ms, out, ref) -> None:
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    meta = dict(environment(device, world_size), config=args.config, layers=cfg["num_layers"],
                heads=cfg["num_attention_heads"], dim=cfg["num_attention_heads"] * cfg["attention_head_dim"],
                tokens=tokens, latent=[args.batch, cfg["in_channels"], args.frames, args.height, args.width],
                dtype=args.dtype, mode=mode, transport=transport, compile=args.compile)
    row = dict(cp_ms=cp_ms, single_ms=single_ms, speedup=single_ms / cp_ms, max_rel_err=err)
    meta["weights"] = "random"
    meta["compiled_with"] = (None if not args.compile else
                             "torch.compile(fullgraph=True)" if args.no_overlap else "cp_ops.compile (overlap pass)")
    print(f"\ncp-ops run wan — Wan {args.config} architecture, random weights ({cfg['num_layers']} layers, "
          f"{meta['heads']} heads, dim {meta['dim']}), latent {meta['latent']} = {tokens} tokens, {args.dtype}, "
          f"CP{world_size} mode={mode} transport={transport} compile={meta['compiled_with'] or 'no'}, "
          f"on {meta.get('gpu', 'CPU')}")
    print(f"{'CP ms':>10} {'1-rank ms':>10} {'speedup':>8} {'max rel err':>12}")
    print(f"{cp_ms:>10.2f} {single_ms:>10.2f} {row['speedup']:>7.2f}x {err:>12.2e}")
    print(f"speedup = 1-rank time ÷ CP time (ideal {world_size}x); times are medians of {args.repeats} runs, CP = the "
          "slowest rank; max rel err = max |CP − 1-rank| / max |1-rank| (0 = bitwise equal).")
    if device.type == "cpu":
        print(f"CPU: a functional check, not a performance claim — the model is small (Wan {args.config} config) and "
              "gloo's copies cost more than the attention they split, so a speedup below 1 is expected.")
    if args.out:
        _write_json(args.out, {"meta": meta, "result": row})
    else:
        print("(no JSON written: --out PATH saves the result)")
