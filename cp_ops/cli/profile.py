"""``cp-ops run --profile DIR``: a torch.profiler trace of the CP run and where its time goes, per layer.

:func:`profile_run` marks every block and replicated module (``ModelSpec.replicated``) with ``record_function``
ranges, profiles ``--profile-runs`` forwards into ``DIR/trace_rank{r}.json.gz`` (https://ui.perfetto.dev opens it) and
computes :func:`breakdown`, per forward (``layers``: the mean block, ``per_layer``: each):

- ``span_ms``: CUDA: first to last kernel launched in the range; CPU: the range's wall time;
- ``busy_ms`` / ``idle_ms``: the union of device intervals in the span / the rest (CUDA: GPU idle, typically the host
  not keeping up; CPU: time outside profiled ops, i.e. Python);
- ``attention_ms``, ``comm_ms``: intervals under an attention / communication op (:data:`_ATTN`, :data:`_COMM`);
  ``exposed_comm_ms``: the part no other interval of the range covers (CPU: all of it, the host waits in it);
- ``replicated_ms``: busy time in the replicated modules; ``gather_ms``: communication outside every block and
  replicated range (the output gather);
- ``host_syncs``: events that make the host wait for the device (:data:`_SYNC_RUNTIME` but async, DtoH copies,
  :data:`_SYNC_OPS`), per range.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
from collections import defaultdict

import torch

FORWARD = "cp-ops forward"
LAYER = "cp-ops layer "
REPLICATED = "cp-ops replicated "

_ATTN = ("scaled_dot_product", "attention", "flash", "fmha", "sdpa", "cudnn_generated_fort_native_sdpa")
_COMM = ("nccl", "c10d", "all_gather", "allgather", "all_to_all", "alltoall", "reduce_scatter", "broadcast",
         "gloo", "cp_ops::agkv_gather_start", "cp_ops::ulysses", "wait_tensor", "record_param_comms", "nvshmem",
         "memcpy ptop", "cp_fast")
_SYNC_RUNTIME = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_SYNC_OPS = ("aten::item", "aten::_local_scalar_dense")
#: the interval statistics of a range (:func:`breakdown`), ms per forward
_STATS = ("span_ms", "busy_ms", "idle_ms", "attention_ms", "comm_ms", "exposed_comm_ms")


def _has(name: str, words) -> bool:
    n = name.lower()
    return any(w.lower() in n for w in words)


def annotate(model: torch.nn.Module, spec, compiled: str | None = None) -> list:
    """Install ``record_function`` ranges on ``model``'s blocks (``spec.blocks``) and replicated modules
    (``spec.replicated``: a module name or the last components of one); returns the hook handles.

    ``compiled='regional'``: the blocks' forwards are compiled, so modules inside blocks get no range (a hook added
    there would land inside a fullgraph region); ``'full'``: nothing is annotated (the whole forward is one graph)."""
    handles = []
    if compiled == "full":
        return handles

    def add(module, label):
        stack = []

        def pre(mod, args):
            rf = torch.profiler.record_function(label)
            rf.__enter__()
            stack.append(rf)

        def post(mod, args, out):
            if stack:
                stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    inside = set()
    if compiled:  # every module inside a compiled block (compiled.repeated_blocks: also e.g. Z-Image's refiners)
        from ..integrations.diffusers.compiled import repeated_blocks

        inside = {id(m) for b in repeated_blocks(model, spec.blocks) for m in b.modules() if m is not b}
    for kind in spec.blocks:
        for i, block in enumerate(getattr(model, kind, [])):
            add(block, f"{LAYER}{kind}.{i}")
    for name, module in model.named_modules():
        hit = next((r for r in spec.replicated if name == r or name.endswith("." + r)), None)
        if compiled and (name.split(".")[0] in spec.blocks or id(module) in inside):
            continue
        if name and hit:
            add(module, f"{REPLICATED}{hit}")  # one label per kind (e.g. attn2.to_k of every block)
    return handles


def _union(iv):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(iv) -> float:
    return sum(e - s for s, e in _union(iv))


def _minus(a, b) -> float:
    return _length(a) - _intersect(_union(a), _union(b))


#: the classes of GPU time in one CP attention call's trace (:func:`attention_timeline`)
KERNEL_CLASSES = ("attn", "merge", "comm", "wait", "other")


def kernel_class(event: dict) -> str:
    """The class (one of :data:`KERNEL_CLASSES`) of one Chrome-trace GPU event."""
    name = event.get("name", "").lower()
    if event.get("cat") == "gpu_memcpy" or "nccl" in name or "copy2d_kernel" in name:  # copy2d: fast's SM copies
        return "comm"
    if "merge" in name:
        return "merge"
    if any(w in name for w in ("wait_kernel", "wait_all_kernel", "begin_kernel", "signal_kernel")):
        return "wait"  # the fast transport's flag protocol (csrc/cp_fast.cu): spins and one-thread flag writes
    return "attn" if any(w in name for w in ("cudnn", "flash", "fmha", "sdpa", "attention", "attn")) else "other"


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def attention_timeline(events: list[dict], calls: int) -> dict:
    """µs per call of each class, span, busy, idle and overlap from Chrome-trace GPU events (``ts``/``dur`` in
    µs); ``top``: the 8 kernels of most total time (name, count, µs per call)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"span": 0.0}
    iv: dict = {c: [] for c in KERNEL_CLASSES}
    per_name: dict[str, list[float]] = {}
    for e in gpu:
        c = kernel_class(e)
        iv[c].append((e["ts"], e["ts"] + e["dur"]))
        per_name.setdefault(e["name"][:90], []).append(e["dur"])
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    work = _union([i for c in KERNEL_CLASSES if c != "wait" for i in iv[c]])
    compute = _union(iv["attn"] + iv["merge"] + iv["other"])
    comm = _union(iv["comm"])
    row = {c: _length(_union(iv[c])) / calls for c in KERNEL_CLASSES}
    row.update(span=(end - start) / calls, busy=_length(work) / calls,
               overlap=_intersect(compute, comm) / calls)
    row["idle"] = row["span"] - row["busy"]
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:8]
    row["top"] = [(n, len(d), sum(d) / calls) for n, d in top]
    return row


def breakdown(trace_path: str) -> dict:
    """The breakdown of a Chrome trace written by ``torch.profiler`` (see the module docstring). Times in ms
    per profiled forward. Raises ``ValueError`` when the trace has no ``cp-ops forward`` range."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    ann = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("cp-ops ")]
    forwards = [e for e in ann if e["name"] == FORWARD]
    if not forwards:
        raise ValueError(f"{trace_path}: no '{FORWARD}' range in the trace; was it written by cp-ops run --profile?")
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
               and "args" in e}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cuda = bool(kernels)

    # host-side containment: the ops and annotations enclosing a host timestamp (per thread)
    by_tid = defaultdict(list)
    for e in ops + ann:
        by_tid[(e["pid"], e["tid"])].append(e)
    for v in by_tid.values():
        v.sort(key=lambda e: e["ts"])

    starts = {k: [e["ts"] for e in v] for k, v in by_tid.items()}
    longest = {k: max((e["dur"] for e in v), default=0) for k, v in by_tid.items()}

    def enclosing(tid, ts):
        v = by_tid.get(tid, [])
        hi = bisect.bisect_right(starts.get(tid, []), ts)
        lo = bisect.bisect_left(starts.get(tid, []), ts - longest.get(tid, 0))
        return [e for e in v[lo:hi] if e["ts"] <= ts <= e["ts"] + e["dur"]]

    fidx = {id(f): i for i, f in enumerate(forwards)}

    def fwd_of(stack):
        """Index of the profiled forward whose range encloses this host event (None: outside every forward)."""
        return next((fidx[id(e)] for e in stack if id(e) in fidx), None)

    def region(stack):
        inner = [e for e in stack if e["name"].startswith((LAYER, REPLICATED))]
        return max(inner, key=lambda e: e["ts"])["name"] if inner else None

    # the intervals: (region, category, start, end, forward) with times in µs; CUDA: each kernel, by its launch's
    # enclosing ops; CPU: every op at any depth, by its own name (unions below: nesting counts once; a compiled
    # region's wrapper op is compute, the communication/attention ops it calls keep their category)
    items, dtoh = [], defaultdict(int)
    for ev in kernels if cuda else ops:
        host = runtime.get(ev.get("args", {}).get("correlation")) if cuda else ev
        if host is None:
            continue
        stack = enclosing((host["pid"], host["tid"]), host["ts"])
        fid = fwd_of(stack)
        if fid is None:
            continue
        names = [e["name"] for e in stack] + [ev["name"]] if cuda else [ev["name"]]
        cat = ("comm" if any(_has(n, _COMM) for n in names) else
               "attention" if any(_has(n, _ATTN) for n in names) else "compute")
        items.append((region(stack), cat, ev["ts"], ev["ts"] + ev["dur"], fid))
        if cuda and ("DtoH" in ev["name"] or "Device -> Host" in ev["name"]):
            dtoh[region(stack)] += 1
    # host syncs, by region
    syncs = defaultdict(int)
    for e in list(runtime.values()) + ops:
        n = e["name"]
        if (n.startswith(_SYNC_RUNTIME) and "Async" not in n) or n in _SYNC_OPS:
            stack = enclosing((e["pid"], e["tid"]), e["ts"])
            if any(s["name"] == FORWARD for s in stack):
                syncs[region(stack)] += 1

    for r, n in dtoh.items():  # a device-to-host copy: the host waits for it (counted once with its sync call)
        syncs[r] = max(syncs[r], n)
    nfwd = len(forwards)

    def stats(sel, span=None):
        iv = [(s, e) for _, _, s, e, _ in sel]
        if not iv:
            return None
        lo, hi = (min(s for s, _ in iv), max(e for _, e in iv)) if span is None else span
        busy = _length(iv)
        comm = [(s, e) for _, c, s, e, _ in sel if c == "comm"]
        other = [(s, e) for _, c, s, e, _ in sel if c != "comm"]
        # on the host (CPU run) the thread waits through every communication op: all of it is exposed
        exposed = _minus(comm, other) if cuda else _length(comm)
        return dict(span_ms=(hi - lo) / 1e3, busy_ms=busy / 1e3, idle_ms=max(0.0, (hi - lo) - busy) / 1e3,
                    attention_ms=_length([(s, e) for _, c, s, e, _ in sel if c == "attention"]) / 1e3,
                    comm_ms=_length(comm) / 1e3, exposed_comm_ms=exposed / 1e3)

    layer_names = sorted({r for r, *_ in items if r and r.startswith(LAYER)},
                         key=lambda n: (n.split()[-1].rsplit(".", 1)[0], int(n.rsplit(".", 1)[1])))
    per_layer = {}
    for name in layer_names:
        sel = [x for x in items if x[0] == name]
        if cuda:  # per forward: span from the first to the last kernel of this layer in that forward
            parts = [([x for x in sel if x[4] == i], None) for i in range(nfwd)]
        else:  # per range of this layer
            parts = [([x for x in sel if a["ts"] <= x[2] <= a["ts"] + a["dur"]], (a["ts"], a["ts"] + a["dur"]))
                     for a in ann if a["name"] == name]
        d = dict.fromkeys(_STATS, 0.0)
        for part, span in parts:
            for k, v in (stats(part, span) or {}).items():
                d[k] += v
        d = {k: v / nfwd for k, v in d.items()}
        d["host_syncs"] = syncs.get(name, 0) / nfwd
        per_layer[name.removeprefix(LAYER)] = d
    whole = [stats([x for x in items if x[4] == i], None if cuda else (f["ts"], f["ts"] + f["dur"])) or {}
             for i, f in enumerate(forwards)]
    total = {k: sum(w.get(k, 0.0) for w in whole) / nfwd for k in (whole[0] if whole else {})}
    rep = [x for x in items if x[0] and x[0].startswith(REPLICATED)]
    total["replicated_ms"] = _length([(s, e) for _, _, s, e, _ in rep]) / 1e3 / nfwd
    total["gather_ms"] = _length([(s, e) for r, c, s, e, _ in items if r is None and c == "comm"]) / 1e3 / nfwd
    total["host_syncs"] = sum(syncs.values()) / nfwd
    mean = {k: sum(d[k] for d in per_layer.values()) / len(per_layer) for k in next(iter(per_layer.values()), {})}
    return dict(device="cuda" if cuda else "cpu", forwards=nfwd, trace=os.path.abspath(trace_path), forward=total,
                layers=mean, per_layer=per_layer,
                replicated={r.removeprefix(REPLICATED): _length([(s, e) for rr, _, s, e, _ in rep if rr == r]) / 1e3 / nfwd
                            for r in sorted({x[0] for x in rep})},
                host_syncs_by_region={(k or "(outside blocks)"): v / nfwd for k, v in syncs.items()})


def profile_run(model, m, spec, kw, args, device, rank: int, world_size: int) -> dict:
    """Profile ``args.profile_runs`` CP forwards of ``m`` (``model`` parallelized, maybe compiled; already
    warm), write ``DIR/trace_rank{rank}.json.gz`` and return this rank's :func:`breakdown` (also written as
    ``DIR/breakdown_rank{rank}.json``)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    os.makedirs(args.profile, exist_ok=True)
    handles = annotate(model, spec, args.compile)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with torch.no_grad():
            spec.predict(m, kw)  # the hooks' first pass, outside the trace
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            with profile(activities=acts) as prof:
                for _ in range(args.profile_runs):
                    if args.compile and args.cuda_graphs is True:  # per-block graphs (reduce-overhead)
                        torch.compiler.cudagraph_mark_step_begin()
                    with record_function(FORWARD):
                        spec.predict(m, kw)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    finally:
        for h in handles:
            h.remove()
    path = os.path.join(args.profile, f"trace_rank{rank}.json.gz")  # gzip: a 30-layer trace is tens of MB
    prof.export_chrome_trace(path)
    bd = breakdown(path)
    bd.update(rank=rank, world_size=world_size, compiled=args.compile)
    with open(os.path.join(args.profile, f"breakdown_rank{rank}.json"), "w") as f:
        json.dump(bd, f, indent=1)
    return bd


def print_breakdown(bd: dict) -> None:
    """Print rank ``bd['rank']``'s breakdown: the whole forward, the mean layer, the replicated modules."""
    cpu = bd["device"] == "cpu"
    what = "host CPU ops only (no GPU in this run): busy = op time, idle = time between ops" if cpu else \
        "GPU kernels: busy = union of kernel time, idle = GPU waiting (host-bound gaps)"
    print(f"\nprofile (rank {bd['rank']}, {bd['forwards']} forward(s), {what}); trace: {bd['trace']}")
    if bd.get("compiled") == "full":
        print("--compile full: one graph, no per-layer ranges (use --compile regional for per-layer rows)")
    elif bd.get("compiled"):
        print("--compile regional: ranges on the blocks and the modules outside them (none inside a compiled block)")
    cols = (*_STATS, "host_syncs")
    print(f"{'':<28}" + "".join(f"{c.removesuffix('_ms'):>14}" for c in cols))

    def line(label, d):
        print(f"{label:<28}" + "".join(f"{d.get(c, 0.0):>14.3f}" for c in cols))

    line("forward", bd["forward"])
    if bd["layers"]:
        for name, d in bd["per_layer"].items():
            line(f"  {name}"[:28], d)
        line(f"mean of {len(bd['per_layer'])} layers", bd["layers"])
    f = bd["forward"]
    print(f"replicated work {f['replicated_ms']:.3f} ms/forward "
          f"({', '.join(f'{k} {v:.3f}' for k, v in bd['replicated'].items()) or 'none marked'}); "
          f"final gather (communication outside the blocks) {f['gather_ms']:.3f} ms; "
          f"host syncs {f['host_syncs']:.0f} per forward"
          + (f" ({', '.join(f'{k}: {v:.0f}' for k, v in bd['host_syncs_by_region'].items())})"
             if bd["host_syncs_by_region"] else ""))
    print("ms per forward; exposed comm = communication no other work of the same range overlaps; every rank's "
          "breakdown in breakdown_rank*.json next to the traces (rank 0's also in --out).")
