"""``cp-ops bound``'s report: the result rows (bound, cost, host time, steps), the tables, and the profiles (one
profiled forward of every side, summarised by kernel category)."""

from __future__ import annotations

import os
import time
from collections import defaultdict

import torch

from .bound_sides import HOST_BOUND, Side, _sync, mode_name


#: kernel/op name fragments per category (first match wins), lower case
CATEGORIES = (
    ("attention", ("fmha", "flash", "sdpa", "attention", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
    ("copy", ("memcpy", "memset", "copy", "catarray", "aten::cat", "aten::repeat", "fill", "aten::zero")),
    ("triton", ("triton",)),
)

#: profiler rows with device time that are not kernels: host ops (their kernels are counted), CUPTI's "Command Buffer
#: Full" (the host blocked on a full launch queue: the device is the bottleneck, not device work itself)
HOST_SIDE = ("aten::", "cp_ops::", "c10d::", "_c10d", "Torch-Compiled", "CompiledFunction", "cudaGraph", "## ",
             "Command Buffer Full")


def category(name: str) -> str:
    n = name.lower()
    return next((cat for cat, words in CATEGORIES if any(w in n for w in words)), "other")


def kernel_summary(events, cuda: bool) -> dict:
    """``{'busy_ms', 'by_category': {cat: ms}, 'top': [[name, ms, calls], ...], 'host_ms', 'host_top'}`` of one
    profiled forward: busy = on CUDA the self device time of kernels and memcpy/memset, on CPU the self CPU time of
    every op; ``host_*``: the self CPU time of every host event but the ``cuda*Synchronize`` waits (where a
    host-bound forward's time goes, the profiler's overhead included), and the 12 largest."""
    rows, host = [], []
    for e in events:
        if e.self_cpu_time_total > 0 and "Synchronize" not in e.key:  # a cuda*Synchronize is the host waiting
            host.append((e.key, e.self_cpu_time_total / 1e3, e.count))
        if cuda:
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
            if not t or e.key.startswith(HOST_SIDE):
                continue  # host-side ops whose self device time is their kernels' (counted as kernels), CUPTI markers
        else:
            t = e.self_cpu_time_total
        if t > 0:
            rows.append((e.key, t / 1e3, e.count))
    by: dict = defaultdict(float)
    for name, ms, _ in rows:
        by[category(name)] += ms
    rows.sort(key=lambda r: -r[1])
    host.sort(key=lambda r: -r[1])
    return dict(busy_ms=sum(r[1] for r in rows), by_category=dict(by), top=[[n[:120], ms, c] for n, ms, c in rows[:12]],
                host_ms=sum(r[1] for r in host), host_top=[[n[:120], ms, c] for n, ms, c in host[:12]])


def _profile_sides(sides: list[Side], device, out_dir: str, tag: str) -> dict:
    """One profiled forward of every side, summarised by :func:`kernel_summary` (returned); each side's Chrome trace
    goes to ``out_dir/trace_<tag>_<side>.json.gz``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    result = {}
    for s in sides:
        s.call()
        _sync(device)
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            s.call()
            _sync(device)
        wall = (time.perf_counter() - t0) * 1e3
        result[s.name] = dict(wall_ms=wall, **kernel_summary(prof.key_averages(), device.type == "cuda"))
        os.makedirs(out_dir, exist_ok=True)
        name = "".join(c if c.isalnum() else "_" for c in f"{tag}_{s.name}")
        prof.export_chrome_trace(os.path.join(out_dir, f"trace_{name}.json.gz"))
    return result


#: the models' standard step counts (diffusers pipelines' defaults): --steps N below it is extrapolated
STANDARD_STEPS = {"flux": 28, "qwenimage": 28, "zimage": 8, "wan": 50, "hunyuanvideo": 50, "ltx": 50}

#: what a --steps row says about the final latents' error (a fake group cannot give it)
STEPS_ERROR_NOTE = ("not measured: a fake group's collectives move nothing (every rank's data is this rank's), so "
                    "rank 0's latents are not CP's; the drift over steps needs real ranks (cp-ops run --steps N under "
                    "torchrun) or, for FP8 communication, CP_OPS_EMULATE_COMM=1 on a group of one rank (docs/fp8.md)")


def _rows(sides, args, spec, cfg, config_name, layers, tokens, base_mode, graphs) -> list[dict]:
    by = {s.name: s for s in sides}
    single = [s for s in sides if s.kind in ("diffusers", "group1")]
    best = min(single, key=lambda s: s.ms - s.fill_ms)
    one = best.ms - best.fill_ms
    steps = getattr(args, "steps", 0) or 0
    common = dict(model=args.model, cls=spec.cls, config=config_name, layers=layers[0] if len(layers) == 1 else layers,
                  tokens=tokens, compile=base_mode if base_mode != "eager" else False, cuda_graphs=graphs)
    ref = by["diffusers"].out

    def timed(s: Side) -> dict:  # what every timed CP side's row holds
        net = s.ms - s.fill_ms  # the fake collectives' writes taken out; the bound: None where nothing is left
        return dict(one_gpu_ms=one, one_gpu_from=best.name, diffusers_ms=by["diffusers"].ms, rank0_ms=net,
                    bound_speedup=one / net if net > 0 else None, rank0_raw_ms=s.ms, fill_ms=s.fill_ms,
                    fills=len(s.fills) if s.fill_count is None else s.fill_count,  # --side-processes: counted there
                    first_call_s=s.first_s, rank0_samples=s.samples, **_host(s, steps=steps))

    out = []
    for w in args.bound:
        cp = by[f"cp_ops W{w}"]
        row = dict(common, world_size=w, impl="cp_ops", mode=cp.mode, **timed(cp),
                   **_host(by["diffusers"], "diffusers_", steps), **_no_time_left(cp))
        if "group of 1" in by:
            row["group1_ms"] = by["group of 1"].ms
            row.update(_host(by["group of 1"], "group1_", steps))
        plain = by.get(f"plain W{w}")
        if plain is not None:  # both raw: each pays its stand-in writes (cp: the fake collectives'; plain: repeats)
            row.update(plain_ms=plain.ms, plain_fill_ms=plain.fill_ms, cp_ops_cost_ms=cp.ms - plain.ms,
                       cp_ops_cost_pct=100.0 * (cp.ms - plain.ms) / cp.ms, **_host(plain, "plain_", steps))
        rows = [row]
        for s in (x for x in sides if x.kind == "dcp" and x.world == w):  # the peers' own CP beside cp_ops'
            if s.error is not None:
                rows.append(dict(common, world_size=w, impl=f"{s.peer} {s.mode}", mode=s.label or s.mode,
                                 skipped=s.error))
                continue
            shape_ok = s.out is not None and tuple(s.out.shape) == tuple(ref.shape)
            finite = bool(shape_ok and torch.isfinite(s.out).all())
            why = ([] if finite else ["the output is not finite or not the full shape: a collective's output was "
                                      "left unwritten (stale memory), so its kernels did not run on real data"]) \
                + list(_no_time_left(s).values())
            rows.append(dict(common, world_size=w, impl=f"{s.peer} {s.mode}", mode=s.label, **timed(s),
                             output_shape_ok=shape_ok, outputs_finite=finite,
                             **({"invalid": "; ".join(why)} if why else {}),
                             **({} if base_mode == "eager" else dict(fullgraph=s.fullgraph)),
                             **({"fullgraph_error": s.fullgraph_error} if s.fullgraph_error else {})))
        if steps:
            for r in rows:
                if "skipped" not in r:
                    _add_steps(r, steps, by, args.model)
        out += rows
    return out


def _host(side: Side, prefix: str = "", steps: int = 0) -> dict:
    """``{prefix + 'host_ms', prefix + 'host_bound'}`` of ``side`` (the host's time to enqueue one forward, and whether
    it reaches :data:`HOST_BOUND` of the side's measured time ``ms``); ``{}`` where not timed, and for a ``steps``
    loop (it reads its per-step CUDA events at its end, so its call waits for the device: host = wall)."""
    if side.host_ms is None or steps:
        return {}
    return {prefix + "host_ms": side.host_ms, prefix + "host_bound": side.host_bound}


def _no_time_left(side: Side) -> dict:
    """``{'invalid': why}`` where ``side``'s fill copies, timed alone, take at least its whole forward (rank 0 -
    fill <= 0: timing noise on a tiny model, or copies the forward hid): no bound can be read from it; else ``{}``."""
    if side.ms - side.fill_ms > 0:
        return {}
    return {"invalid": f"no time left for rank 0: its fill copies timed alone ({side.fill_ms} ms) take at least its "
                       f"whole forward ({side.ms} ms); no bound (--unwritten times it without the fills)"}


def _add_steps(row: dict, steps: int, by: dict, model: str) -> None:
    """A --steps row: its times are whole loops of ``steps`` steps; per step, the steps run, and where ``steps`` is
    below the model's standard count the totals extrapolated to it (per-step time x the standard count)."""
    side = by[f"{row['impl']} W{row['world_size']}"]
    std = STANDARD_STEPS.get(model)
    row.update(steps=steps, steps_run=len(side.step_ms), total_ms=row["rank0_ms"], step_ms=row["rank0_ms"] / steps,
               one_gpu_step_ms=row["one_gpu_ms"] / steps, rank0_step_samples_ms=side.step_ms,
               max_rel_err=None, max_rel_err_note=STEPS_ERROR_NOTE)
    if std:
        row["standard_steps"] = std
        if steps != std:
            row.update(one_gpu_total_standard_ms=row["one_gpu_step_ms"] * std, total_standard_ms=row["step_ms"] * std,
                       extrapolated=f"{steps} of {std} steps timed; totals for {std} = per-step time x {std}")


def print_table(rows: list[dict], meta: dict) -> None:
    print(f"\nzero-communication bound, {meta['cls']} {meta['config']}, {meta['tokens']} tokens, on "
          f"{meta.get('gpu', 'CPU')} (fake group: rank 0 of W, transport torch, chunks {meta['chunks']})"
          + ("; compiled without the overlap pass (--no-overlap)" if meta.get("overlap_pass") is False else ""))
    has_cost = any("cp_ops_cost_ms" in r for r in rows)  # the column only where --cost measured it
    steps = next((r["steps"] for r in rows if r.get("steps")), 0)
    has_impl = any(r.get("impl", "cp_ops") != "cp_ops" for r in rows)  # --compare PEER[,PEER...]
    if steps:
        print(f"a denoising loop of {steps} steps per sample: the times are whole loops (ms), 'ms/step' rank 0's")
    has_host = any("host_ms" in r for r in rows)
    print(f"{'compile':<17} {'W':>3}" + (f" {'impl':>17}" if has_impl else "") + f" {'mode':>8} {'1 device ms':>12} "
          f"{'from':>11} {'rank 0 ms':>10} {'fill ms':>8}" + (f" {'host ms':>9}" if has_host else "")
          + (f" {'ms/step':>9}" if steps else "") + f" {'bound':>7}"
          + (f" {'cp_ops cost':>16}" if has_cost else "")
          + (f" {'plain ms':>9} {'plain host':>10}" if has_cost and has_host else ""))
    for r in rows:
        name = mode_name(r["compile"] or "eager", r["cuda_graphs"])
        if "skipped" in r:  # the W and impl columns aligned, then the reason
            who = (f" {r['world_size']:>3}" + (f" {r.get('impl', 'cp_ops'):>17}" if has_impl else "")
                   if "world_size" in r else "")
            print(f"{name:<17}{who} failed: {r['skipped']}")
            continue
        cost = (f"{r['cp_ops_cost_ms']:>7.2f} ms {r['cp_ops_cost_pct']:>5.1f}%" if r.get("cp_ops_cost_ms") is not None else "")
        bound_text = f"{r['bound_speedup']:>6.2f}x" if r.get("bound_speedup") is not None else f"{'-':>7}"
        plain = (f" {r['plain_ms']:>9.2f} {_host_text(r, 'plain_'):>10}" if "plain_ms" in r
                 else f" {'':>9} {'':>10}") if has_cost and has_host else ""
        print(f"{name:<17} {r['world_size']:>3}" + (f" {r.get('impl', 'cp_ops'):>17}" if has_impl else "")
              + f" {r['mode']:>8} {r['one_gpu_ms']:>12.2f} "
              f"{'diffusers' if r['one_gpu_from'] == 'diffusers' else 'group of 1':>11} {r['rank0_ms']:>10.2f} "
              f"{r.get('fill_ms', 0.0):>8.2f}" + (f" {_host_text(r)}" if has_host else "")
              + (f" {r['step_ms']:>9.2f}" if steps else "")
              + f" {bound_text}" + (f" {cost:>16}" if has_cost else "") + plain
              + (f"  invalid: {r['invalid']}" if r.get("invalid") else ""))
    print("bound = 1-device time / rank 0's time of a W-rank fake group (no transfer: no CP run can beat it); "
          "rank 0 = its measured forward minus 'fill': the device copies that write the fake collectives' outputs "
          "with real data (timed alone); "
          "1 device = the faster of diffusers' own path and cp_ops over a group of 1; "
          + ("cp_ops cost = rank 0 minus the same forward with plain local attention of the same shapes (--cost), % of "
             "rank 0's forward." if has_cost else "--cost adds cp_ops' own cost inside the bound."))
    if has_host:
        print(("host ms (plain host: the --cost plain side's)" if has_cost else "host ms")
              + " = the host's time to enqueue one forward (the call's wall time, not waited for; median), beside "
              f"the measured (device-timed) forward; * = host-bound: host >= {HOST_BOUND:g} x the measured time "
              "(rank 0 raw = rank 0 + fill), so the device waited for the host and that row's time is host time"
              + (" (CPU: host = wall, every row)." if "gpu" not in meta else "."))
    if has_impl:
        print("impl 'PEER ulysses|ring' = that library's own CP (diffusers: enable_parallelism; paraattn, xdit, "
              "cache-dit: as their READMEs parallelize a diffusers transformer) over the same fake group, its "
              "collectives written like cp_ops' (cp_ops.cli.bound_fill); its bound beside cp_ops'; a peer that "
              "refuses the model or layout: failed, with its reason (cp_ops.cli.bound_peers).")
    if steps:
        print(f"--steps: final latents' error vs one device: {STEPS_ERROR_NOTE}.")
        ext = next((r for r in rows if "extrapolated" in r), None)
        if ext is not None:
            print(f"{ext['extrapolated']} (JSON: one_gpu_total_standard_ms, total_standard_ms).")
    if "gpu" not in meta:
        print("CPU: a functional check, not a performance claim (a tiny model: bounds near or below 1x are expected; "
              "docs/measuring.md).")


def _host_text(r: dict, prefix: str = "") -> str:
    """A row's host time (ms) with ``*`` when host-bound, 9 wide; blank where not timed."""
    h = r.get(prefix + "host_ms")
    if h is None:
        return f"{'':>9}"
    return f"{h:>8.2f}" + ("*" if r.get(prefix + "host_bound") else " ")


def print_profiles(profiles: dict) -> None:
    cats = ("attention", "gemm", "copy", "triton", "other")
    for mode, sides in profiles.items():
        print(f"\nprofile [{mode}]: one forward, device time by kernel category (ms)")
        print(f"{'side':<14} {'wall':>9} {'busy':>9} " + " ".join(f"{c:>9}" for c in cats))
        for name, p in sides.items():
            print(f"{name:<14} {p['wall_ms']:>9.2f} {p['busy_ms']:>9.2f} "
                  + " ".join(f"{p['by_category'].get(c, 0.0):>9.2f}" for c in cats))


def _samples_spread(samples) -> str:
    if not samples or len(samples) < 2:
        return ""
    return f"{min(samples):.0f}–{max(samples):.0f}"


def results_table(rows: list[dict]) -> str:
    """The Markdown table of bound rows (``--out`` JSONs' ``rows``): one line per row, a failed mode with its reason; a
    host column (rank 0 / plain, ``*`` host-bound) where any row has host times (``benchmarks/bound_table.py``)."""
    host = any("host_ms" in r for r in rows)  # the host's time to enqueue a forward
    out = ["| model (tokens) | compile | W | mode | 1 GPU ms (from) | rank 0 ms (measured min–max − fill) | bound | "
           "cp_ops cost ms (%) |" + (" host ms rank 0 / plain (* host-bound) |" if host else ""),
           "|---|---|---|---|---|---|---|---|" + ("---|" if host else "")]
    for r in rows:
        comp = (r.get("compile") or "eager") + (" + capture" if r.get("cuda_graphs") == "forward" else
                                                " + graphs" if r.get("cuda_graphs") else "")
        if "skipped" in r:  # a mode that failed (no W), or one side that did (a peer refusing: its W and impl)
            who = f"{r['impl']} ({r.get('mode', '')})" if r.get("impl", "cp_ops") != "cp_ops" else ""
            out.append(f"| {r['model']} {r['config']} | {comp} | {r.get('world_size', '')} | {who} | "
                       f"failed: {r['skipped']} | | | |" + (" |" if host else ""))
            continue
        src = "diffusers" if r["one_gpu_from"] == "diffusers" else "group of 1"
        cost = f"{r['cp_ops_cost_ms']:.2f} ({r['cp_ops_cost_pct']:.1f}%)" if r.get("cp_ops_cost_ms") is not None else ""
        mode = r["mode"] if r.get("impl", "cp_ops") == "cp_ops" else f"{r['impl']} ({r['mode']})"  # --compare
        bound = "-" if r.get("bound_speedup") is None else f"{r['bound_speedup']:.2f}x"
        if r.get("invalid"):
            bound += f" invalid: {r['invalid']}"
        out.append(f"| {r['model']} {r['config']} ({r['tokens']}) | {comp} | {r['world_size']} | {mode} | "
                   f"{r['one_gpu_ms']:.1f} ({src}) | {r['rank0_ms']:.1f} ({_samples_spread(r.get('rank0_samples'))}"
                   f"{' − %.1f' % r['fill_ms'] if 'fill_ms' in r else ''}) | "
                   f"{bound} | {cost} |" + (f" {_host_cell(r)} |" if host else ""))
    return "\n".join(out)


def _host_cell(r: dict) -> str:
    """``rank 0's host ms[*] / the plain side's[*]`` (``*``: host-bound); '' where the row has none."""
    parts = [f"{r[p + 'host_ms']:.1f}{'*' if r.get(p + 'host_bound') else ''}"
             for p in ("", "plain_") if r.get(p + "host_ms") is not None]
    return " / ".join(parts)
