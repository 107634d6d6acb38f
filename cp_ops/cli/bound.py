"""``cp-ops bound MODEL --worlds W[,W...]``: the zero-communication bound of a DiT on ONE device.

The model is parallelized over a *fake* process group of W ranks (this process is rank 0, collectives move nothing),
so one forward does exactly rank 0's work plus cp_ops' host path: ``bound(W) = t(one device) / t(rank 0 of W)``. The
sides, fills, compile modes, rounds and rows: ``docs/measuring.md``. This module runs the command; the sides are in
:mod:`.bound_sides`, the worker processes in :mod:`.bound_procs`, the report in :mod:`.bound_report`.
"""

from __future__ import annotations

import gc
import json
import os
import time
from types import SimpleNamespace

import torch
import torch._dynamo
import torch.distributed as dist

from ..integrations.diffusers import _private
from ..integrations.diffusers.dispatch import cp_ops_backend
from ..timing import time_ms
from . import bound_fill, bound_peers
from .bench import DTYPES, _write_json, environment
from .models import MODELS, build, config_label, load_checkpoint
from .bound_procs import _serve, precompile, spawn_sides, stop_sides
from .bound_report import _profile_sides, _rows, print_profiles, print_table
from .bound_sides import Side, _prepare, _reason, _time_sides, parse_mode


def fake_groups(worlds, filled: bool = True) -> dict[int, dist.ProcessGroup]:
    """A fake process group of each size in ``worlds`` (this process = rank 0 of each): the default group of
    ``max(worlds)`` ranks (created here when torch.distributed is not initialized), the others
    ``dist.new_group(range(W))`` in it. ``filled``: groups made here write their outputs (:mod:`.bound_fill`).

    Raises:
        RuntimeError: torch.distributed is already initialized with another backend or a smaller world.
    """
    import contextlib

    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the 'fake' backend

    top = max(worlds)
    making = bound_fill.filled if filled else contextlib.nullcontext
    if not dist.is_initialized():
        with making():
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=top)
    elif dist.get_backend() != "fake" or dist.get_world_size() < top or dist.get_rank() != 0:
        raise RuntimeError(f"cp-ops bound needs a fake default process group of >= {top} ranks with this "
                           f"process as rank 0; torch.distributed is initialized with backend "
                           f"{dist.get_backend()!r}, world size {dist.get_world_size()}, rank {dist.get_rank()}")
    with making():
        return {w: (dist.group.WORLD if w == dist.get_world_size() else dist.new_group(list(range(w))))
                for w in sorted(set(worlds))}


def _sides_for(args, heads: int | None, choose_mode) -> list[Side]:
    """Every side of one compile mode, in build order (``heads`` None: the names alone, no CP mode chosen)."""
    sides = [Side("diffusers", "diffusers", 1)]
    if not args.no_group1:
        sides.append(Side("group of 1", "group1", 1, mode="agkv"))
    for w in args.bound:
        mode = None if heads is None else choose_mode(args.mode, heads, w)
        sides.append(Side(f"cp_ops W{w}", "cp", w, mode=mode))
        if args.cost:
            sides.append(Side(f"plain W{w}", "plain", w, mode=mode))
        for peer in compared(args):  # other libraries' CP (cp_ops.cli.bound_peers), each of its layouts
            sides += [Side(f"{peer} {layout} W{w}", "dcp", w, mode=layout, peer=peer)
                      for layout in bound_peers.PEERS[peer].layouts]
    return sides


def compared(args) -> list[str]:
    """The peers ``--compare`` names (a list, or one comma-separated string), in order; [] without it."""
    names = getattr(args, "compare", None) or []
    return [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]


def _mode_args(args, base: str, graphs: bool):
    return SimpleNamespace(compile=None if base == "eager" else base, cuda_graphs=graphs,
                           no_overlap=bool(getattr(args, "no_overlap", False)),
                           steps=getattr(args, "steps", 0) or 0, cfg=False)


def run_bound(args, device: torch.device) -> list[dict]:
    """The body of ``cp-ops bound MODEL ...`` (arguments checked by :mod:`.bound_args`), in one process: returns the
    result rows, prints the table, ``--out`` writes them as JSON. A fake default group is created and destroyed here
    when torch.distributed is not initialized (else: :func:`fake_groups`' rule)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if getattr(args, "compile_workers", 0) and not getattr(args, "only_side", None):
        precompile(args, device, _sides_for, run_bound)
    # every side of every W compiles each block class again (its shapes differ): past Dynamo's default limit of 8
    key = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    created = not dist.is_initialized()
    groups = fake_groups([1] + list(args.bound), filled=not getattr(args, "unwritten", False))
    try:
        with torch._dynamo.config.patch(**{key: max(getattr(torch._dynamo.config, key), 64)}):
            return _run(args, device, groups)
    finally:
        if created:  # the default group this call made (and every group inside it)
            dist.destroy_process_group()


def _fx_cache_counts() -> tuple[int, int, int, int]:
    """(hits, misses) of Inductor's FX graph cache, then of AOTAutograd's cache, in this process so far (a miss
    of AOTAutograd's includes a bypass: a graph it does not cache)."""
    from torch._dynamo.utils import counters

    aot = counters["aot_autograd"]
    return (counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"],
            aot["autograd_cache_hit"], aot["autograd_cache_miss"] + aot["autograd_cache_bypass"])


def _run(args, device: torch.device, groups: dict) -> list[dict]:
    from .. import choose_mode

    spec = MODELS[args.model]
    dtype = DTYPES[args.dtype]
    only = getattr(args, "only_side", None)  # a --compile-workers / --side-processes child: (mode, side name)
    serve = getattr(args, "serve", None)  # a --side-processes child: (pipe to the parent, the parent's model)
    remote = bool(getattr(args, "side_processes", False)) and only is None  # sides in their own processes
    if serve:  # the parent's model, its weights shared with this process (CUDA IPC / shared memory): no copy
        base = serve[1]
        cfg = dict(base.config) if args.checkpoint else spec.config(args.config, args.layers)
    elif args.checkpoint:
        base, cfg = load_checkpoint(spec, args.checkpoint, device, dtype)
    else:
        base, cfg = build(spec, args.config, args.layers, device, dtype)
    g = torch.Generator(device=device).manual_seed(42)
    kw = spec.make_inputs(cfg, args.text_tokens, args.batch, args.frames, args.height, args.width, device, dtype, g)
    if device.type == "cuda":
        base.set_attention_backend("_native_cudnn")
    # diffusers' backend 'cp_ops' registered before any side compiles: registered later (by the first parallelize), it
    # changes the registry the diffusers side's compiled blocks guard on, and they compile again in the rounds
    _private.register_backend(cp_ops_backend)
    if compared(args):  # the same for what the peers register process-wide (cp_ops.cli.bound_peers)
        bound_peers.prepare(compared(args))
    written = bound_fill.is_filled(groups[max(groups)])
    tokens = spec.tokens(cfg, args.frames, args.height, args.width)
    layers = [cfg[k] for k in spec.layer_keys]
    config_name = config_label(spec, args.config, cfg)
    meta = dict(environment(device, 1), model=args.model, cls=spec.cls, config=config_name,
                layers=layers[0] if len(layers) == 1 else layers, tokens=tokens, text_tokens=args.text_tokens,
                latent=[args.batch, args.frames, args.height, args.width], dtype=args.dtype, transport="torch",
                chunks=args.chunks, group="fake (torch.testing._internal.distributed.fake_pg), rank 0 of W",
                warmup=args.warmup, rounds=args.repeats, compile_workers=getattr(args, "compile_workers", 0),
                weights="checkpoint" if args.checkpoint else "random",
                steps=getattr(args, "steps", 0) or 0, compare=getattr(args, "compare", None),
                overlap_pass=not getattr(args, "no_overlap", False),
                fill_timing=("replayed alone in one CUDA graph: device time" if device.type == "cuda"
                             else "replayed alone, launched back to back"),
                fake_outputs=("written: this rank's data in every slot of every data collective's output, one copy "
                              "per output tensor (cp_ops.cli.bound_fill.FilledFakeGroup)" if written
                              else "unwritten (--unwritten)"),
                side_processes=("every side of a compiled mode built, compiled and timed in its own process "
                                "(--side-processes), on this process's weights (shared, not copied), its forwards "
                                "when this process asks: one side's at a time" if remote else False))
    if only is None:
        print(f"cp-ops bound {args.model} --worlds {','.join(map(str, args.bound))}: {spec.cls} {config_name}, "
              f"{tokens} tokens (+{args.text_tokens} text), {args.dtype}, on {meta.get('gpu', 'CPU')}", flush=True)
    rows, profiles, first_calls = [], {}, {}
    for mode_text in args.bound_compile:
        base_mode, graphs = parse_mode(mode_text)
        margs = _mode_args(args, base_mode, graphs)
        sides = _sides_for(args, spec.heads(cfg), choose_mode)
        if only is not None:
            for s in sides:
                if (mode_text, s.name) == tuple(only):
                    _prepare(s, base, spec, kw, margs, device, groups, args)
                    if serve:
                        _serve(s, device, serve[0])
                        return []  # one side of one mode per process (a mode named twice: served once)
            continue
        t_mode, cache0 = time.perf_counter(), _fx_cache_counts()

        def built(s: Side, how: str = "") -> None:
            print(f"  [{mode_text}] {s.name}: built in {s.build_s:.1f} s, first call {s.first_s:.1f} s{how}"
                  + (f", then {s.second_ms:.2f} ms" if s.second_ms is not None else ""), flush=True)
            # in the JSON before the rounds: a run killed while other sides compile still has what each built one took
            first_calls.setdefault(mode_text, []).append(dict(
                side=s.name, kind=s.kind, world_size=s.world, mode=s.mode, build_s=s.build_s, first_call_s=s.first_s,
                second_call_ms=s.second_ms))
            if args.out:  # quietly: the mode's end says where it wrote
                _write_json(args.out, dict(meta=meta, rows=rows, profiles=profiles, first_calls=first_calls),
                            quiet=True)

        try:
            if remote:
                print(f"  [{mode_text}] {len(sides)} sides in their own processes (--side-processes), built at once "
                      "on this process's weights", flush=True)
                spawn_sides(args, device, mode_text, sides, base, run_bound)
                for s in sides:
                    built(s, " (in its process, beside the others' compiles)")
            for s in sides if not remote else ():
                try:
                    _prepare(s, base, spec, kw, margs, device, groups, args)
                except Exception as e:  # noqa: BLE001 - a peer's CP refusing is a row with its reason
                    if s.kind != "dcp":
                        raise
                    s.error, s.call = _reason(e), None
                    print(f"  [{mode_text}] {s.name}: failed: {s.error}", flush=True)
                    # not Dynamo's reset: the sides built before would all compile again in the rounds
                    _free(device, reset=False)
                    continue
                if not margs.steps:  # one more forward, timed alone: a run killed before the rounds keeps it
                    s.second_ms = time_ms(s.call, device, 0, 1)
                built(s)
            if getattr(args, "compile_workers", 0) and base_mode != "eager":
                hit, miss, ahit, amiss = (a - b for a, b in zip(_fx_cache_counts(), cache0))
                meta.setdefault("fx_graph_cache", {})[mode_text] = dict(hits=hit, misses=miss)
                meta.setdefault("aot_autograd_cache", {})[mode_text] = dict(hits=ahit, misses=amiss)
                print(f"  [{mode_text}] Inductor's FX graph cache: {hit} hits, {miss} misses; AOTAutograd's: {ahit} "
                      f"hits, {amiss} misses (after --compile-workers; what a first call still costs is Dynamo's "
                      "tracing)",
                      flush=True)
            t_rounds = time.perf_counter()
            _time_sides([s for s in sides if s.error is None], device, args.warmup, args.repeats)
            print(f"  [{mode_text}] interleaved rounds in {time.perf_counter() - t_rounds:.0f} s", flush=True)
            for s in sides:
                if s.proc is None:
                    s.fill_ms = bound_fill.replay_ms(s.fills, device) if s.fills else 0.0
                else:  # replayed in the side's process, no other side running
                    s.fill_ms = s.ask(("fill",))
            if args.profile:
                profiles[mode_text] = _profile_sides([s for s in sides if s.error is None], device, args.profile,
                                                     f"{args.model}_{mode_text}")
        except Exception as e:  # noqa: BLE001 - a mode that cannot run is a row with its reason
            reason = _reason(e)
            print(f"  [{mode_text}] failed: {reason}", flush=True)
            rows.append(dict(model=args.model, config=config_name, compile=base_mode, cuda_graphs=graphs,
                             skipped=reason))
        else:
            rows += _rows(sides, args, spec, cfg, config_name, layers, tokens, base_mode, graphs)
            _check_outputs(sides, filled=written)
        finally:
            print(f"  [{mode_text}] every side built and timed in {time.perf_counter() - t_mode:.0f} s", flush=True)
            stop_sides(sides)
            for s in sides:
                s.call = None
            sides = None
            _free(device, reset=base_mode != "eager" and not remote)
        if args.out:  # after every mode: a later mode that is killed (a time limit) keeps the earlier rows
            _write_json(args.out, dict(meta=meta, rows=rows, profiles=profiles, first_calls=first_calls))
    if only is not None:
        return []
    print_table(rows, meta)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        path = os.path.join(args.profile, f"bound_profile_{args.model}_{'_'.join(args.bound_compile)}.json")
        with open(path, "w") as f:
            json.dump(dict(meta=meta, profiles=profiles), f, indent=1)
        print_profiles(profiles)
        print(f"profile: {path}")
    return rows


def _free(device, reset: bool) -> None:
    """Free what a mode's sides (or a side that failed half-way) held; ``reset``: Dynamo's compiled code too."""
    if reset:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _check_outputs(sides: list[Side], filled: bool = False) -> None:
    """Every side returned the full output shape, finite where it is the model's own and, with ``filled`` (the fake
    collectives write their outputs: :mod:`cp_ops.cli.bound_fill`), on every cp_ops side too (not the plain
    stand-in's repeated tokens; nor, unfilled, a fake group's untouched gather buffers: uninitialised memory)."""
    ref = next(s.out for s in sides if s.kind == "diffusers")
    for s in sides:
        if s.kind == "dcp":  # a peer's own CP: what it returned goes into its row (output_shape, outputs_finite)
            continue
        if s.out is None or tuple(s.out.shape) != tuple(ref.shape):
            raise RuntimeError(f"bound: side {s.name!r} returned shape {None if s.out is None else tuple(s.out.shape)}, "
                               f"expected the full output {tuple(ref.shape)}")
    for s in sides:
        if (s.kind in ("diffusers", "group1") or (filled and s.kind == "cp")) and not torch.isfinite(s.out).all():
            raise RuntimeError(f"bound: side {s.name!r} returned non-finite values")
