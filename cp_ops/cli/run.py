"""``cp-ops run MODEL``: a real diffusers DiT (random seeded weights, or a local checkpoint), one rank vs CP.

Same model and inputs on every rank: the single-rank baseline on rank 0 (cuDNN attention on CUDA), then with
``--compare diffusers`` diffusers' own CP (Ulysses W, ring W) on copies, then cp_ops'
:func:`~cp_ops.integrations.diffusers.parallelize` in place (``--cfg``: cond and uncond halves on two CFG lanes). Each
row: time (CP = the slowest rank), speedup, max relative error. An unsupported model exits 3 with one line saying so.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist

from . import mesh_comm
from .bench import DTYPES, _write_json, available_cores, cpu_threads, environment
from .models import MODELS, build, config_label, load_checkpoint
from ._args import per_block_graphs, whole_capture
from ..integrations.diffusers.compiled import compile_blocks, uncompile_blocks
from ..timing import Graphed, interleaved_rounds, max_over_ranks, max_over_ranks_each, time_ms

#: exit code of a run whose model (or --cfg layout) cp_ops.parallelize does not support
UNSUPPORTED = 3


def exit_unsupported(rank: int, line: str) -> None:
    """A model or layout parallelize does not support: rank 0 prints ``line``, every rank exits :data:`UNSUPPORTED`."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(UNSUPPORTED)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compile_model(model, spec, args, overlap: bool, kw_in: dict | None = None):
    """Compile ``model`` as ``--compile`` says; returns ``(callable model, compiled block forwards)``: ``regional``
    compiles each block class once (module hooks stay eager), ``full`` the whole model after one eager forward on
    ``kw_in`` where given (state built at the first call, e.g. Z-Image's RoPE table, is traced built)."""
    import cp_ops

    if not args.compile:
        return model, 0
    # dynamic=False: else the 1-rank model compiling again in the interleaved rounds beside the CP model gets
    # symbolic sizes; fullgraph=False only from cp-ops bound (a peer's CP side Dynamo cannot trace whole)
    kw = dict(fullgraph=getattr(args, "fullgraph", True), overlap=overlap and not args.no_overlap, dynamic=False)
    if per_block_graphs(args):
        kw["mode"] = "reduce-overhead"
    if args.compile == "full":
        if kw_in is not None:
            with torch.no_grad():
                spec.predict(model, kw_in)
        return cp_ops.compile(model, **kw), 1
    return model, compile_blocks(model, cuda_graphs=per_block_graphs(args), overlap=kw["overlap"], blocks=spec.blocks,
                                 fullgraph=kw["fullgraph"])


def _mark_step(args) -> None:
    """A new CUDA-graph-tree step (``mode='reduce-overhead'``): the previous call's outputs may be overwritten."""
    if per_block_graphs(args):
        torch.compiler.cudagraph_mark_step_begin()


def _forward_fn(m, spec, kw, args):
    def fwd():
        _mark_step(args)
        with torch.no_grad():
            return spec.predict(m, kw)
    return fwd


def denoise(m, spec, kw, steps: int, device, args=None, guidance: float = 5.0):
    """``steps`` steps of the model's scheduler from the latents in ``kw`` (not modified): ``(final latents fp32,
    per-step ms)``, a step = the transformer call + the scheduler update (CUDA: between events, no host wait).
    ``args.cfg``: each step feeds ``cat([x, x])`` and combines ``u + guidance * (c - u)``, as the pipelines do."""
    sched = spec.scheduler()
    sched.set_timesteps(steps, device=device)
    kw = dict(kw)
    key = "t" if "t" in kw else "timestep"
    tdtype, batch = kw[key].dtype, kw[key].shape[0]
    cfg = bool(args is not None and getattr(args, "cfg", False))
    lat = spec.get_latents(kw).clone()
    if cfg:
        lat = lat[: lat.shape[0] // 2]
    cuda = device.type == "cuda"
    marks = []
    with torch.no_grad():
        for t in sched.timesteps:
            marks.append(_mark(cuda))
            spec.set_latents(kw, torch.cat([lat, lat]) if cfg else lat)
            kw[key] = spec.model_timestep(t.float()).expand(batch).to(tdtype)
            if args is not None:
                _mark_step(args)
            pred = spec.predict(m, kw)
            if cfg:
                cond, uncond = pred.chunk(2)
                pred = uncond + guidance * (cond - uncond)
            lat = sched.step(pred, t, lat, return_dict=False)[0]
        marks.append(_mark(cuda))
    if cuda:
        marks[-1].synchronize()
        return lat.float(), [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    return lat.float(), [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


def _mark(cuda: bool):
    """A point in time: a recorded CUDA event (no host wait), else ``perf_counter()``."""
    if not cuda:
        return time.perf_counter()
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def _measure(m, spec, kw, args, device, group=None):
    """Time ``m`` as the args say. Returns ``(first call s, per-call or per-step ms list, output fp32, call)``:
    ``call()`` runs one more forward the same way (None with ``--steps``)."""
    if whole_capture(args):  # diffusers code a capture refuses, replaced by equivalents (before the
        from ..integrations.diffusers import capture_safe  # first call: a compiled forward sees the replacement)

        capture_safe.apply(m)
    fwd = _forward_fn(m, spec, kw, args)
    _sync(device)
    t0 = time.perf_counter()
    if args.steps:
        denoise(m, spec, kw, 1, device, args)  # the first call: compiles when compiling
    else:
        fwd()
    _sync(device)
    first_s = time.perf_counter() - t0
    if args.steps:
        for _ in range(max(0, min(args.warmup, 1))):
            denoise(m, spec, kw, args.steps, device, args)
        out, ms = denoise(m, spec, kw, args.steps, device, args)
        return first_s, ms, out, None
    # group: the ranks of a collective forward agree on the capture's outcome (a failure raises on all of them)
    call = Graphed(fwd, device, group=group) if whole_capture(args) else fwd
    ms = [time_ms(call, device, args.warmup, args.repeats)]
    return first_s, ms, call().float(), call


def _row(name, first_s, ms, out, ref, single, device, steps):
    ms = max_over_ranks_each(ms, device)
    t = statistics.median(ms)
    first = max_over_ranks(first_s, device)
    row = dict(name=name, ms=t, first_call_s=first, compile_s=max(0.0, first - t / 1e3))
    if steps:
        row.update(total_ms=sum(ms), step_ms=ms)
    if ref is not None:
        row["max_rel_err"] = ((out - ref).abs().max() / ref.abs().max()).item()
    if single is not None:
        row["speedup"] = single / t
    return row


def _diffusers_rows(base, spec, kw, args, device, world, ref, single_ms, keep: list | None = None):
    """Rows of diffusers' native CP (Ulysses W, ring W) on copies of ``base`` (still unparallelized). ``keep``: a
    list that gets ``(row, call)`` of every row that ran (its model kept alive for :func:`_interleaved`)."""
    from diffusers import ContextParallelConfig

    from .bound_diffusers import logger_compat

    rows = []
    logger_compat()
    for label, cpc in (("diffusers ulysses", dict(ulysses_degree=world)), ("diffusers ring", dict(ring_degree=world))):
        reason = None
        if device.type == "cpu":
            reason = ("diffusers' enable_parallelism needs an accelerator (it places rank r on device "
                      "r % torch.accelerator.device_count(), 0 on a CPU-only torch)")
        else:
            try:
                m = copy.deepcopy(base)
                m.enable_parallelism(config=ContextParallelConfig(**cpc))
                m, _ = compile_model(m, spec, args, overlap=False, kw_in=kw)
                first_s, ms, out, call = _measure(m, spec, kw, args, device, group=dist.group.WORLD)
            except Exception as e:  # noqa: BLE001 - diffusers refusing is a row with its reason, not a failed run
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        # any rank failed: every rank skips the row (no rank waits in a collective alone)
        if max_over_ranks(float(reason is not None), device):
            rows.append(dict(name=label, skipped=reason or "refused on another rank"))
        else:
            rows.append(_row(label, first_s, ms, out, ref, single_ms, device, args.steps))
            if keep is not None and call is not None:
                keep.append((rows[-1], call))
        m = call = None
        if args.compile:
            torch._dynamo.reset()
    return rows


def _can_interleave(model, args, device) -> bool:
    """Whether the final times come from interleaved rounds (:func:`_interleaved`): no ``--steps``, no
    ``--cuda-graphs``, and room for the copies on every rank (agreed)."""
    wanted = not args.steps and not args.cuda_graphs  # the same arguments on every rank
    t = torch.tensor([int(wanted and _room_for_copies(model, args, device))], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    if wanted and not t.item() and dist.get_rank() == 0:  # whichever rank lacked the room
        print("cp-ops run: too little free GPU memory to keep every side's model for interleaved timing: "
              "each side is timed once, one after another", flush=True)
    return bool(t.item())


def _room_for_copies(model, args, device) -> bool:
    """Whether this rank has room for the model copies :func:`_interleaved` keeps alive (the 1-rank model and, with
    ``--compare``, diffusers' two): their weights within half the free GPU memory; always on CPU."""
    if device.type != "cuda":
        return True
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return weights * (3 if args.compare else 1) < 0.5 * torch.cuda.mem_get_info(device)[0]


def _interleaved(single_row, single_call, cp, args, device, rank: int) -> None:
    """Time every side again in ``args.repeats`` interleaved rounds (the 1-rank model on rank 0 alone, then every CP
    row of ``cp`` = ``[(row, call)]``), so drift hits every side alike; the first times stay as ``ms_sequential``
    (``speedup_sequential``). One untimed forward of each first (a side whose Dynamo cache was reset compiles)."""
    dist.barrier()
    if rank == 0:
        single_call()
    for _, call in cp:
        call()
    (single_s,), cp_s = interleaved_rounds([single_call], [call for _, call in cp], args.repeats,
                                           lambda fn: time_ms(fn, device, 0, 1))
    t = torch.tensor([statistics.median(single_s) if rank == 0 else 0.0], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    single = float(t.item())
    if single_row is not None:
        single_row.update(ms_sequential=single_row["ms"], ms=single)
    for (row, _), samples in zip(cp, cp_s):
        ms = statistics.median(max_over_ranks_each(samples, device))
        row.update(ms_sequential=row["ms"], ms=ms, speedup=single / ms,
                   **({"speedup_sequential": row["speedup"]} if "speedup" in row else {}))


def run_model(rank: int, world_size: int, device: torch.device, args) -> None:
    """Rank body of ``cp-ops run MODEL`` (arguments checked by :mod:`cp_ops.cli.main` before the ranks start)."""
    from cp_ops import choose_mode, select_transport
    from cp_ops.integrations.diffusers import parallelize

    spec = MODELS[args.model]
    cpu_threads(rank, world_size, device, "run", available_cores())
    dtype = DTYPES[args.dtype]
    if args.checkpoint:
        model, cfg = load_checkpoint(spec, args.checkpoint, device, dtype)
    else:
        model, cfg = build(spec, args.config, args.layers, device, dtype)
    batch = args.batch * (2 if args.cfg else 1)  # --cfg: conditional + unconditional halves
    g = torch.Generator(device=device).manual_seed(42)
    kw = spec.make_inputs(cfg, args.text_tokens, batch, args.frames, args.height, args.width, device, dtype, g)
    if device.type == "cuda":
        model.set_attention_backend("_native_cudnn")
    tokens = spec.tokens(cfg, args.frames, args.height, args.width)
    from ..comm_dtype import parse as parse_comm_dtype
    from ..plan.rules import fp8_mode

    cp_world, fmts = world_size // (2 if args.cfg else 1), parse_comm_dtype(getattr(args, "comm_dtype", "none"))
    # the mode the calls run: 'auto' with K and V apart in --comm-dtype runs Ulysses where W divides H (fp8_mode)
    mode = choose_mode(fp8_mode(args.mode, fmts, spec.heads(cfg), cp_world)[0], spec.heads(cfg), cp_world)
    transport = select_transport(args.transport, device.type)

    # one forward per row: every side is timed again in interleaved rounds at the end (see _interleaved); the
    # 1-rank model is then a copy, kept beside the parallelized one
    interleave = _can_interleave(model, args, device)
    single_ms, ref, rows, single_call, cp_calls, single_model = None, None, [], None, [], None
    if rank == 0:
        if args.compile:
            print(f"compiling the single-rank model ({args.compile}) ...", flush=True)
        single_model = copy.deepcopy(model) if interleave else model
        m, _ = compile_model(single_model, spec, args, overlap=False, kw_in=kw)
        first_s, ms, ref, single_call = _measure(m, spec, kw, args, device)
        single_ms = statistics.median(ms)
        rows.append(dict(name="1 rank", ms=single_ms, first_call_s=first_s, compile_s=max(0.0, first_s - single_ms / 1e3),
                         **(dict(total_ms=sum(ms), step_ms=ms) if args.steps else {})))
        if args.compile and not interleave:  # undo regional compilation: the CP side compiles afresh
            uncompile_blocks(model, spec.blocks)
        if args.compile:
            torch._dynamo.reset()
        del m
    dist.barrier()
    if args.compare:
        t = torch.tensor([single_ms or 0.0], dtype=torch.float64, device=device)
        dist.broadcast(t, 0)
        rows += _diffusers_rows(model, spec, kw, args, device, world_size, ref, float(t.item()),
                                keep=cp_calls if interleave else None)
    shape, mesh = getattr(args, "mesh", None), None
    if shape is not None:  # 2-D CP (with --cfg: the CFG lanes x 2-D mesh)
        mesh = mesh_comm.build(shape, device.type, cfg=args.cfg)
        mode = "agkv_ulysses"
    how = dict(group=mesh) if mesh is not None else dict(mode=mode, comm_dtype=fmts)
    if mesh is None and args.cfg:
        how["cfg_parallel"] = True
    try:  # cuda_graphs=False: run compiles and captures itself
        parallelize(model, transport=args.transport, chunks=getattr(args, "chunks", None), cuda_graphs=False, **how)
    except (ValueError, TypeError) as e:
        if "support" in str(e) or "cfg_parallel" in str(e):
            what = "the CFG-parallel layout (--cfg) of " if args.cfg else ""
            exit_unsupported(rank, f"cp-ops run {args.model}: cp_ops.parallelize does not support {what}{spec.cls} "
                                   f"here: {e}")
        raise
    by_dim = None
    if mesh is not None:  # the attention calls of one eager forward, then each dim's collectives for them, alone
        by_dim = mesh_comm.forward_dim_times(model, spec, kw, mesh, args.transport, device)
    if rank == 0 and args.compile:
        print(f"compiling the CP{world_size} model ({args.compile}) ...", flush=True)
    m, nblocks = compile_model(model, spec, args, overlap=True, kw_in=kw)
    first_s, ms, out, call = _measure(m, spec, kw, args, device, group=dist.group.WORLD)
    rows.append(_row(f"cp_ops {mode}" + (f" {shape[0]}x{shape[1]}" if mesh is not None else ""), first_s, ms, out,
                     ref, single_ms, device, args.steps))
    if by_dim is not None:
        rows[-1].update(comm_ms_by_dim=by_dim["ms"], ulysses_comm_ms=by_dim["ms"]["ulysses"],
                        agkv_comm_ms=by_dim["ms"]["agkv"], attention_calls=by_dim["calls"])
    if interleave:
        _interleaved(rows[0] if rank == 0 else None, single_call, cp_calls + [(rows[-1], call)], args, device, rank)
    single_call = cp_calls = single_model = None  # the kept copies: freed before --profile and the report
    breakdown = None
    if args.profile:
        from .profile import profile_run

        breakdown = profile_run(model, m, spec, kw, args, device, rank, world_size)
    error = None
    if rank == 0:
        try:
            report(args, spec, cfg, device, world_size, tokens, mode, transport, rows, breakdown, nblocks, mesh)
        except Exception as e:  # noqa: BLE001 - surface rank 0's error, not a peer's lost connection
            error = e
    dist.barrier()
    if error is not None:
        raise error


def report(args, spec, cfg, device, world_size, tokens, mode, transport, rows, breakdown, nblocks, mesh=None) -> None:
    ours = rows[-1]
    single = rows[0]
    layers = [cfg[k] for k in spec.layer_keys]
    heads = spec.heads(cfg)
    dim = cfg.get("dim") or heads * cfg["attention_head_dim"]
    latent = [args.batch * (2 if args.cfg else 1), cfg["in_channels"] // (4 if spec.name in ("flux", "qwenimage") else 1),
              args.frames, args.height, args.width]
    layers_txt = "+".join(map(str, layers))
    compiled_with = (None if not args.compile else
                     f"{'torch.compile' if args.no_overlap else 'cp_ops.compile (overlap pass)'}, {args.compile}"
                     + (", reduce-overhead (CUDA graphs)" if per_block_graphs(args) else
                        ", the whole forward captured in one CUDA graph" if args.cuda_graphs else ""))
    meta = dict(environment(device, world_size), model=args.model, cls=spec.cls, config=args.config,
                config_label=config_label(spec, args.config, cfg),
                checkpoint=args.checkpoint, layers=layers[0] if len(layers) == 1 else layers, heads=heads, dim=dim,
                tokens=tokens, text_tokens=args.text_tokens, latent=latent, dtype=args.dtype, mode=mode,
                transport=transport, chunks=getattr(args, "chunks", None) or "auto", compile=args.compile or False,
                cuda_graphs=args.cuda_graphs, cfg=args.cfg,
                steps=args.steps, weights="checkpoint" if args.checkpoint else "random", compiled_with=compiled_with,
                comm_dtype=getattr(args, "comm_dtype", "none"))
    if args.compile:
        meta["compiled_blocks"] = nblocks
    if mesh is not None:
        meta["mesh"] = dict(shape=list(args.mesh), dims=list(mesh.mesh_dim_names), label=mesh_comm.label(mesh))
    weights = f"checkpoint {args.checkpoint}" if args.checkpoint else "random weights"
    name = {"wan": "Wan"}.get(args.model, spec.cls)
    print(f"\ncp-ops run {args.model} — {name} {meta['config_label']} architecture, {weights} ({layers_txt} layers, "
          f"{heads} heads, dim {dim}), latent {latent} = {tokens} tokens, "
          f"{args.dtype}, " + (f"CFG-parallel: 2 lanes x CP{world_size // 2}" if args.cfg else f"CP{world_size}")
          + (f" on a {meta['mesh']['label']}" if mesh is not None else "")
          + f" mode={mode} transport={transport} chunks={'None (the heuristic)' if meta['chunks'] == 'auto' else meta['chunks']} compile={compiled_with or 'no'}"
          + (f" comm={meta['comm_dtype']}" if meta["comm_dtype"] not in ("none", "bf16") else "")
          + f", on {meta.get('gpu', 'CPU')}")
    if args.model == "wan" and not (args.steps or args.compare or args.compile):
        # the original `cp-ops run wan` table (kept)
        print(f"{'CP ms':>10} {'1-rank ms':>10} {'speedup':>8} {'max rel err':>12}")
        print(f"{ours['ms']:>10.2f} {single['ms']:>10.2f} {ours['speedup']:>7.2f}x {ours['max_rel_err']:>12.2e}")
    else:
        unit = "ms/step" if args.steps else "ms"
        print(f"{'':<18} {unit:>10} {'total ms' if args.steps else '':>10} {'speedup':>8} {'max rel err':>12}"
              f"{'  compile s' if args.compile else ''}")
        for r in rows:
            if "skipped" in r:
                print(f"{r['name']:<18} skipped: {r['skipped']}")
                continue
            sp = f"{r['speedup']:>7.2f}x" if "speedup" in r else f"{'':>8}"
            err = f"{r['max_rel_err']:>12.2e}" if "max_rel_err" in r else f"{'(reference)':>12}"
            tot = f"{r['total_ms']:>10.1f}" if args.steps else f"{'':>10}"
            fc = f"  {r['compile_s']:>9.1f}" if args.compile else ""
            print(f"{r['name']:<18} {r['ms']:>10.2f} {tot} {sp} {err}{fc}")
    print(f"speedup = 1-rank time ÷ CP time (ideal {world_size}x); "
          + (f"ms/step = median over the {args.steps} steps of one loop (transformer + scheduler step), total = their sum"
             if args.steps else f"times are medians of {args.repeats} runs"
             + (" in interleaved rounds (each: the 1-rank model on rank 0 alone, then every CP row once; JSON "
                "ms_sequential: the first, one-side-at-a-time medians)" if "ms_sequential" in ours  # _interleaved ran
                else ", one side after another (not interleaved)"))
          + ", CP = the slowest rank; max rel err = max |CP − 1-rank| / max |1-rank| (0 = bitwise equal).")
    if args.compile:
        print("compile s = wall time of the first call (compilation included) minus one steady-state call"
              + (" (one step)" if args.steps else "") + "; the slowest rank for CP rows.")
    if "comm_ms_by_dim" in ours:
        t = ours["comm_ms_by_dim"]
        print(f"per-dim communication per forward ({ours['attention_calls']} attention calls; each dim's collectives "
              f"timed alone for those calls' shapes, docs/2d.md): ulysses (inner) {t['ulysses']:.3f} ms, agkv (outer) "
              f"{t['agkv']:.3f} ms")
    if device.type == "cpu":
        print(f"CPU: a functional check, not a performance claim — the model is small ({name} {args.config} config) and "
              "gloo's copies cost more than the attention they split, so a speedup below 1 is expected.")
    if breakdown is not None:
        from .profile import print_breakdown

        print_breakdown(breakdown)
    result = {k: v for k, v in ours.items() if k != "name"}
    result.update(cp_ms=ours["ms"], single_ms=single["ms"])
    payload = {"meta": meta, "result": result, "rows": rows}
    if breakdown is not None:
        payload["profile"] = breakdown
    if args.out:
        _write_json(args.out, payload)
    else:
        print("(no JSON written: --out PATH saves the result)")
