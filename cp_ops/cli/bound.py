"""``cp-ops bound MODEL --worlds W[,W...]``: the zero-communication bound of a DiT on ONE device.

The model is parallelized by :func:`cp_ops.integrations.diffusers.parallelize` over a *fake* process group of W
ranks (``torch.testing._internal.distributed.fake_pg``: this process is rank 0 of W, collectives move nothing), so
one forward does exactly rank 0's work — its ``S / W`` tokens (uneven: ``ceil(S / W)``, the most any rank holds), its
queries against all S keys, the replicated text/timestep work — plus cp_ops' host path, without any transfer.

    bound(W) = t(one device) / t(rank 0 of W)

No CP implementation of the same model can beat it (its limits: ``docs/measuring.md``). The fake collectives write
their outputs with this rank's own data (:mod:`cp_ops.cli.bound_fill`; torch 2.11's fake backend leaves them
unwritten, and kernels on stale zeros run faster than on real data): those copies are recorded on each side's first
call, timed alone (``fill_ms``: their device time, replayed in one CUDA graph on CUDA) and taken out of rank 0's
time (``rank0_ms``; measured: ``rank0_raw_ms``).
``--unwritten`` leaves them as torch does. ``t(one device)`` is the
faster of two single-device sides, and each row says which: ``diffusers`` (the unmodified model, attention backend
cuDNN on CUDA) and ``group of 1`` (the model parallelized over a fake group of one rank: cp_ops' path, no split).

Sides, one shared set of weights (each side is a copy of the module tree whose parameters and buffers are the
original's, so a side costs no weight memory): ``diffusers``, ``group of 1``, ``cp_ops W`` for each W and, with
``--cost``, ``plain W``: the ``cp_ops W`` model with every cp_ops attention call replaced by plain local attention
of the same shapes (:class:`PlainAttention`), so ``rank0_ms - plain_ms`` is cp_ops' own cost inside the bound
(host path, padding and mask handling, the collectives' launch and wait; the split/gather hooks stay in both). The
cost compares the two measured times, each with its stand-in for the transfers' writes (cp: the fake collectives'
copies; plain: its repeats, of the same sizes).

Compile modes (``--compile-modes``): ``eager``, ``regional`` (each repeated block compiled, as ``cp-ops run
--compile``), ``full`` (the whole forward, fullgraph), each optionally ``+graphs`` (CUDA graphs: under compile
``mode='reduce-overhead'``, in eager an explicit capture of the forward) or, compiled, ``+capture`` (compiled without
reduce-overhead, then the whole forward captured in one CUDA graph: :class:`cp_ops.timing.Graphed`, the mechanism of
``eager+graphs``; rows say ``cuda_graphs: "forward"``). In each mode every side is compiled the
same way, its first call timed (compile included), then all sides are timed in ``--repeats`` interleaved rounds
(each round one sample of every side; a sample = the median of ``n`` waited-for forwards, ``n`` so that a sample
lasts ~0.2 s), so drift hits every side alike. A mode that fails (e.g. a compile error) becomes a row with its
reason; the other modes still run.

Result rows (``--out``): one per compile mode x W, keys ``model, config, layers, tokens, compile, cuda_graphs,
world_size, one_gpu_ms, rank0_ms, bound_speedup, cp_ops_cost_ms``  and more
(``one_gpu_from``, ``diffusers_ms``, ``group1_ms``, ``plain_ms``, ``cp_ops_cost_pct``, ``mode``, ...).
"""

from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..integrations.diffusers import _private
from ..integrations.diffusers.dispatch import CPAttention, cp_ops_backend
from ..timing import Graphed, time_ms
from . import bound_fill
from .models import MODELS, build, config_label, load_checkpoint
from ._args import whole_capture

#: compile modes --compile-modes takes: a base and an optional "+graphs"
BASES = ("eager", "regional", "full")
#: default modes: CUDA / CPU (CUDA graphs need CUDA; compiling on CPU takes minutes for nothing measured)
DEFAULT_CUDA = ("eager", "regional", "regional+graphs")
DEFAULT_CPU = ("eager",)
#: a sample (median of n forwards) lasts about this long, ms; n in [1, MAX_CALLS]
SAMPLE_MS = 200.0
MAX_CALLS = 10
#: a side is host-bound when the host's time to enqueue a forward is at least this share of its measured time
HOST_BOUND = 0.9


def parse_mode(text: str) -> tuple[str, bool | str]:
    """``'regional+graphs'`` → ``('regional', True)`` (per-block graphs; eager: the whole forward captured),
    ``'regional+capture'`` → ``('regional', 'forward')`` (compiled without reduce-overhead, the whole forward
    captured: ``cuda_graphs`` as ``cp-ops run --cuda-graphs forward`` sets it), ``'eager'`` → ``('eager', False)``.
    Raises ValueError naming the accepted forms (``eager+capture`` too: ``eager+graphs`` is that)."""
    base, _, extra = text.strip().partition("+")
    if base not in BASES or extra not in ("", "graphs", "capture"):
        raise ValueError(f"a compile mode is one of {'|'.join(BASES)}, optionally +graphs (CUDA graphs: eager's "
                         "whole forward, a compiled mode's blocks) or, compiled, +capture (the whole compiled "
                         f"forward in one graph), e.g. regional+graphs, regional+capture; got {text!r}")
    if extra == "capture" and base == "eager":
        raise ValueError(f"a compile mode: eager+graphs already captures the whole eager forward; got {text!r} "
                         "(+capture is for compiled modes: regional+capture, full+capture)")
    return base, {"": False, "graphs": True, "capture": "forward"}[extra]


def mode_name(base: str, graphs: bool | str) -> str:
    return base + ("+capture" if graphs == "forward" else "+graphs" if graphs else "")


# ---- the fake groups and the sides ----------------------------------------------------------------------------

def fake_groups(worlds, filled: bool = True) -> dict[int, dist.ProcessGroup]:
    """A fake process group of each size in ``worlds`` (this process = rank 0 of each): the default group is a
    fake group of ``max(worlds)`` ranks (created here when torch.distributed is not initialized), the others
    ``dist.new_group(range(W))`` inside it. ``filled``: groups made here write their collectives' outputs
    (:mod:`cp_ops.cli.bound_fill`); else torch's fake backend's as they are.

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


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model``'s module tree (own hooks, processors, forwards) whose parameters and buffers ARE
    ``model``'s (no weight memory): what :func:`cp_ops.integrations.diffusers.parallelize` and regional compilation
    modify is per module, never a weight."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


class PlainAttention(CPAttention):
    """Stands in for cp_ops' attention of a parallelized model in the ``plain W`` side: plain local attention of
    the shapes rank 0 of the mode computes, with no cp_ops code (no host path, no collective, no mask or padding
    handling beyond SDPA's own). Copies stand in for the transfers' writes:

    - AGKV (``mode='agkv'``): local Q ``[B, S_local, H, D]`` against K/V of all S tokens (the local block
      repeated W times, cut to S);
    - Ulysses: Q, K, V of all S tokens and ``H / W`` heads (the local block repeated over the sequence, cut to S,
      the first ``H / W`` heads), and the output's first ``S_local`` tokens repeated over the heads.

    A key-padding mask becomes SDPA's bool ``attn_mask`` over the S keys (repeated like K). For a model installed
    from its ``_cp_plan`` (generic: no recorded stream totals) S = W x S_local (exact for even shards). Attention runs on
    cuDNN first on CUDA (as :func:`cp_ops.local_attention`). Output ``[B, S_local, H, D]``, the query's dtype.
    Its values are not the model's (the copies repeat this rank's tokens): a timing stand-in only.
    """

    def __init__(self, cp: CPAttention, mode: str):
        super().__init__(cp.state, cp.streams, cp.where)
        self.mode = mode

    def __call__(self, query, key, value, attn_mask, dropout_p, is_causal, scale):
        st = self.state
        w = st.world
        mask = self.key_mask(attn_mask, query)
        b, s_local, h, _ = query.shape
        # a generic _cp_plan model's modules find their streams per call (no recorded totals): W blocks of this one
        total = sum(st.total(s, self.where) for s in self.streams) if self.streams else w * s_local

        def full(x):  # [B, S_local, ...] -> [B, S, ...]: the local block repeated, cut to S
            return x.repeat(1, w, *([1] * (x.dim() - 2)))[:, :total]

        if self.mode == "ulysses":
            q, k, v = (full(x[:, :, : h // w]) for x in (query, key, value))
        else:
            q, k, v = query, full(key), full(value)
        m = None if mask is None else full(mask)[:, None, None, :]
        out = _sdpa(q, k, v, m, scale)
        if self.mode == "ulysses":
            out = out[:, :s_local].repeat(1, 1, w, 1)
        return out


def _sdpa(q, k, v, mask, scale):
    """BSHD SDPA, cuDNN first on CUDA (then flash, memory-efficient, math), as :func:`cp_ops.local_attention`."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        with sdpa_kernel(order, set_priority=True):
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def to_plain(model: torch.nn.Module, mode: str) -> int:
    """Replace the cp_ops attention of every routed processor of the parallelized ``model`` with
    :class:`PlainAttention`; returns how many. Raises RuntimeError when there is none (not parallelized)."""
    n = 0
    for module in model.modules():
        proc = getattr(module, "processor", None)
        cfg = getattr(proc, "_parallel_config", None)
        if isinstance(cfg, CPAttention) and not isinstance(cfg, PlainAttention):
            proc._parallel_config = PlainAttention(cfg, mode)
            n += 1
    if not n:
        raise RuntimeError("to_plain: no attention processor of this model routes to cp_ops (parallelize it first)")
    return n


@dataclass
class Side:
    """One timed variant of the model in one compile mode."""

    name: str
    kind: str  # 'diffusers' | 'group1' | 'cp' | 'plain' | 'dcp' (diffusers' own CP, --compare diffusers)
    world: int
    mode: str | None = None  # the CP attention mode (cp / plain sides); dcp: the layout ('ulysses' | 'ring')
    call: Callable[[], object] | None = None
    first_s: float = 0.0
    build_s: float = 0.0  # building the side's model before its first call (copy, parallelize, compile wrappers)
    second_ms: float | None = None  # one forward right after the first call, timed alone (a killed run keeps it)
    samples: list = field(default_factory=list)
    host_samples: list = field(default_factory=list)  # per sample: the median host time of its forwards (ms)
    out: torch.Tensor | None = None
    fills: list = field(default_factory=list)  # one forward's fake collective writes (bound_fill.recording)
    fill_ms: float = 0.0  # their device time, replayed alone (bound_fill.replay_ms)
    label: str | None = None  # dcp: what diffusers ran ('ulysses', 'ulysses_anything', 'ring')
    error: str | None = None  # dcp: why the side could not run (a row with the reason; the others still run)
    step_ms: list = field(default_factory=list)  # --steps: the last timed loop's per-step times
    fullgraph: bool = True  # compiled whole (every side) or, a dcp side Dynamo cannot, with graph breaks
    fullgraph_error: str | None = None  # dcp: why fullgraph=True failed
    proc: object = None  # --side-processes: the process that holds and times this side (its pipe: ``conn``)
    conn: object = None
    fill_count: int | None = None  # --side-processes: len(fills) in the side's process (the copies stay there)

    @property
    def ms(self) -> float:
        return statistics.median(self.samples)

    @property
    def host_ms(self) -> float | None:
        """The host's time to enqueue one forward (median over the samples of each sample's median), ms."""
        return statistics.median(self.host_samples) if self.host_samples else None

    @property
    def host_bound(self) -> bool | None:
        """Host-bound: enqueuing a forward takes at least :data:`HOST_BOUND` of its measured time (the device
        waited for the host)."""
        h = self.host_ms
        return None if h is None else h >= HOST_BOUND * self.ms


# ---- measuring -----------------------------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_call(m, spec, kw, margs, device, count=None, step_log=None):
    """The side's call: one forward, or with ``margs.steps`` a denoising loop of that many steps
    (:func:`cp_ops.cli.run.denoise`: the model's scheduler; returns the final latents, ``step_log`` gets the loop's
    per-step ms). ``count[0]`` += 1 per Python-level call, when given; eager+graphs and +capture: captured."""
    from .run import _forward_fn, denoise

    if margs.steps:
        def fwd():
            lat, ms = denoise(m, spec, kw, margs.steps, device, margs)
            if step_log is not None:
                step_log[:] = ms
            return lat
    else:
        fwd = _forward_fn(m, spec, kw, margs)
    if count is not None:
        inner = fwd

        def fwd():
            count[0] += 1
            return inner()
    if whole_capture(margs):  # eager+graphs, regional/full+capture: the whole forward in one graph
        return Graphed(fwd, device)
    return fwd


def _prepare(side: Side, base, spec, kw, margs, device, groups, args) -> None:
    """Build ``side``'s model (a shared copy of ``base``, parallelized for group1/cp/plain, diffusers' CP for dcp),
    compile it as ``margs`` says, run and time its first call; sets ``side.call``, ``side.first_s`` and ``side.out``.

    A dcp side (diffusers' own CP) that Dynamo cannot compile whole (``fullgraph=True``, as every other side) is
    built again and compiled with graph breaks (``fullgraph=False``): ``side.fullgraph_error`` says why."""
    if side.kind != "dcp" or not margs.compile:
        return _build_and_run(side, base, spec, kw, margs, device, groups, args, fullgraph=True)
    try:
        return _build_and_run(side, base, spec, kw, margs, device, groups, args, fullgraph=True)
    except Exception as e:  # noqa: BLE001 - diffusers' CP under Dynamo: retried with graph breaks, the reason kept
        side.fullgraph_error = _reason(e)
        print(f"  {side.name}: fullgraph=True failed ({side.fullgraph_error[:160]}); compiling with graph breaks",
              flush=True)
    gc.collect()
    return _build_and_run(side, base, spec, kw, margs, device, groups, args, fullgraph=False)


def _build_and_run(side: Side, base, spec, kw, margs, device, groups, args, fullgraph: bool) -> None:
    from ..integrations.diffusers import parallelize
    from . import bound_diffusers
    from .run import compile_model

    t_build = time.perf_counter()
    m = shared_copy(base)
    if whole_capture(margs):  # diffusers code a capture refuses, replaced by equivalents (every side alike)
        from ..integrations.diffusers import capture_safe

        capture_safe.apply(m)
    eager_fills = None
    if side.kind == "dcp":
        side.label = bound_diffusers.parallelize(m, side.mode, side.world, spec.heads(base.config), device)
        if margs.compile:  # compiled, diffusers' collectives are traced: the writes are recorded from one eager call
            eager = SimpleNamespace(compile=None, cuda_graphs=False, no_overlap=False, steps=margs.steps, cfg=False)
            with bound_fill.recording() as eager_fills:
                _make_call(m, spec, kw, eager, device)()
    elif side.kind != "diffusers":
        parallelize(m, groups[side.world], mode=side.mode, transport="torch", chunks=args.chunks)
        if side.kind == "plain":
            to_plain(m, side.mode)
    cargs = margs if fullgraph else SimpleNamespace(**vars(margs), fullgraph=False)
    # a whole-model compile after one eager forward (diffusers' CP side: made above, with its writes recorded)
    m, _ = compile_model(m, spec, cargs, overlap=side.kind not in ("diffusers", "dcp"),
                         kw_in=kw if side.kind != "dcp" else None)
    side.fullgraph = fullgraph
    _sync(device)
    t0 = time.perf_counter()
    side.build_s = t0 - t_build
    count = [0]
    with bound_fill.recording() as rec:  # the first call runs Python (later graph replays may not): one forward's writes
        call = _make_call(m, spec, kw, margs, device, count, side.step_ms)
        out = call()
    _sync(device)
    side.first_s = time.perf_counter() - t0
    # eager+graphs, +capture: warm-up and capture forwards, identical (compiled: the first warm-up compiles)
    side.fills = list(eager_fills) if eager_fills is not None else rec[: len(rec) // max(1, count[0])]
    side.call = call
    side.out = out.detach().float().cpu() if isinstance(out, torch.Tensor) else None


def _time_sides(sides: list[Side], device, warmup: int, rounds: int) -> None:
    """``warmup`` untimed forwards of each side, then ``rounds`` interleaved rounds: each takes one sample of every
    side (the median of ``n`` waited-for forwards; ``n`` from the warm-up's time, so a sample lasts ~SAMPLE_MS),
    and the median of the same forwards' host times (:func:`cp_ops.timing.samples_ms`: the call's wall time, not
    waited for)."""
    calls = {}
    for s in sides:
        # n from one forward timed after the untimed warm-up ones (a compile in the first would make n = 1)
        t = _timed(s, device, warmup, 1) if warmup else SAMPLE_MS
        calls[s.name] = max(1, min(MAX_CALLS, int(SAMPLE_MS / max(t, 1e-3))))
    for _ in range(rounds):
        for s in sides:
            host: list = []
            s.samples.append(_timed(s, device, 0, calls[s.name], host=host))
            s.host_samples.append(statistics.median(host))


def _timed(s: Side, device, warmup: int, n: int, host: list | None = None) -> float:
    """:func:`cp_ops.timing.time_ms` of ``s``'s forward: in this process, or (``--side-processes``) in the side's
    own process, which runs it while this one waits (one process's forwards on the device at a time)."""
    if s.conn is None:
        return time_ms(s.call, device, warmup, n, host=host)
    ms, hosts = _ask(s, ("time", warmup, n))
    if host is not None:
        host.extend(hosts)
    return ms


def _profile_sides(sides: list[Side], device, out_dir: str, tag: str) -> dict:
    """One profiled forward of every side: GPU kernel time by category (attention, GEMM, copy, Triton/Inductor,
    other) and the top kernels; on CPU, op time by the same categories. The summary is returned (the caller writes
    it); each side's Chrome trace goes to ``out_dir/trace_<tag>_<side>.json.gz`` (host gaps, per-op launch times)."""
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
    for cat, words in CATEGORIES:
        if any(w in n for w in words):
            return cat
    return "other"


def kernel_summary(events, cuda: bool) -> dict:
    """``{'busy_ms', 'by_category': {cat: ms}, 'top': [[name, ms, calls], ...], 'host_ms', 'host_top'}`` of one
    profiled forward: on CUDA the device time of kernels and memcpy/memset (events with device time and no children
    on the device side), on CPU the self CPU time of every op; ``host_*``: the self CPU time of every host event
    (ops, Python-level ranges, CUDA runtime calls; not the ``cuda*Synchronize`` waits for the device) and the 12
    largest, where a host-bound forward's time goes (the profiler's own overhead included)."""
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
    by = {}
    for name, ms, _ in rows:
        c = category(name)
        by[c] = by.get(c, 0.0) + ms
    rows.sort(key=lambda r: -r[1])
    host.sort(key=lambda r: -r[1])
    return dict(busy_ms=sum(r[1] for r in rows), by_category=by, top=[[n[:120], ms, c] for n, ms, c in rows[:12]],
                host_ms=sum(r[1] for r in host), host_top=[[n[:120], ms, c] for n, ms, c in host[:12]])


# ---- the run -------------------------------------------------------------------------------------------------

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
        if getattr(args, "compare", None) == "diffusers":
            from .bound_diffusers import LAYOUTS

            sides += [Side(f"diffusers {layout} W{w}", "dcp", w, mode=layout) for layout in LAYOUTS]
    return sides


def _mode_args(args, base: str, graphs: bool):
    return SimpleNamespace(compile=None if base == "eager" else base, cuda_graphs=graphs,
                           no_overlap=bool(getattr(args, "no_overlap", False)),
                           steps=getattr(args, "steps", 0) or 0, cfg=False)


def run_bound(args, device: torch.device) -> list[dict]:
    """The body of ``cp-ops bound MODEL ...`` (arguments checked by :mod:`cp_ops.cli.bound_args`); one process.
    Returns the result rows (and prints the table; ``--out`` writes them as JSON with the run's metadata).
    torch.distributed: a fake default group is created and destroyed here when none is initialized (else the
    initialized one must be a fake group of >= max(W) ranks with this process as rank 0: :func:`fake_groups`)."""
    import torch._dynamo

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if getattr(args, "compile_workers", 0) and not getattr(args, "only_side", None):
        precompile(args, device)
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


def _compile_one(args_dict: dict, device: str, mode_text: str, side: str, results) -> None:
    """A :func:`precompile` child (a fresh process): build ``side`` of ``mode_text`` and run its first call (the
    compile) as :func:`run_bound` would; puts ``(mode, side, seconds, error or None)`` on ``results``. Dies with its
    parent (Linux: ``PR_SET_PDEATHSIG``), so a killed run leaves no child holding the device's memory."""
    import contextlib
    import io

    _die_with_parent()
    args = SimpleNamespace(**args_dict)
    args.compile_workers, args.only_side, args.out, args.profile = 0, (mode_text, side), None, None
    t0 = time.perf_counter()
    err = None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run_bound(args, torch.device(device))
    except Exception as e:  # noqa: BLE001 - reported; the parent's own build meets (and reports) it again
        err = _reason(e)
    results.put((mode_text, side, time.perf_counter() - t0, err))


def _die_with_parent(parent_pid: int | None = None) -> None:
    """This child process gets SIGKILL when its parent dies (Linux: ``PR_SET_PDEATHSIG``), so a killed run leaves
    no child holding the device's memory; elsewhere the parent's own clean-up only. ``parent_pid``: a parent that
    died before this call (while the child imported torch) ends the child here."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux / no glibc
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


# ---- --side-processes: each side of a compiled mode built, compiled and timed in its own process ------------------

#: how long a side's process may take to build and compile its side and run its first call (s), and one timing
#: request (s): bounds on every wait for a side's process (a process that dies is noticed within a second)
BUILD_TIMEOUT_S = 3600.0
SAMPLE_TIMEOUT_S = 900.0


def _serve_side(args_dict: dict, device: str, mode_text: str, side: str, conn, base, parent_pid=None) -> None:
    """A ``--side-processes`` child (spawned): build ``side`` of ``mode_text`` as :func:`run_bound` would, on the
    parent's model ``base`` (received with its parameters and buffers shared, not copied: CUDA IPC on CUDA, shared
    memory on CPU; the parent keeps them alive), run its first call, then answer the parent's timing requests on
    ``conn`` (:func:`_serve`) until told to stop. An exception is sent as ``('error', reason)``."""
    import contextlib
    import io

    _die_with_parent(parent_pid)
    args = SimpleNamespace(**args_dict)
    args.compile_workers, args.side_processes, args.out, args.profile = 0, False, None, None
    args.only_side, args.serve = (mode_text, side), (conn, base)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run_bound(args, torch.device(device))
    except Exception as e:  # noqa: BLE001 - the parent turns it into the mode's failed row
        try:
            conn.send(("error", _reason(e)))
        except (OSError, ValueError):  # the parent is gone
            pass


def _serve(s: Side, device, conn) -> None:
    """In a side's process, after its first call: report what the parent's rows need, then answer requests until
    ``('stop',)`` or the pipe closes: ``('time', warmup, n)`` -> ``(median ms, [host ms per run])``
    (:func:`cp_ops.timing.time_ms` after at least one untimed forward: the first forward after another process ran
    is slower), ``('fill',)`` -> the fake collectives' writes replayed alone (ms). The parent asks while no other
    side runs."""
    out = s.out.numpy() if s.out is not None else None  # float32 on the CPU; numpy pickles without shared memory
    conn.send(("built", dict(build_s=s.build_s, first_s=s.first_s, out=out, fill_count=len(s.fills))))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent closed its end
            return
        if msg[0] == "time":
            host: list = []
            conn.send(("ok", (time_ms(s.call, device, max(1, msg[1]), msg[2], host=host), host)))
        elif msg[0] == "fill":
            conn.send(("ok", bound_fill.replay_ms(s.fills, device) if s.fills else 0.0))
        else:
            return


def _ask(s: Side, request: tuple, timeout: float = SAMPLE_TIMEOUT_S):
    """Send ``request`` to ``s``'s process and return its answer (:func:`_recv`); a process already gone is named."""
    try:
        s.conn.send(request)
    except OSError:  # a broken pipe: the process ended
        raise _ended(s, "before this request") from None
    return _recv(s, timeout)


def _ended(s: Side, when: str) -> RuntimeError:
    """The error for ``s``'s process found gone (waited for up to 5 s, for its exit code)."""
    s.proc.join(5)
    return RuntimeError(f"--side-processes: side {s.name!r}: its process ended (exit code {s.proc.exitcode}) {when} "
                        "(killed, e.g. out of memory?)")


def _recv(s: Side, timeout: float):
    """The next answer of ``s``'s process (its payload); raises RuntimeError when the process reports an error or
    ends without answering (killed, e.g. out of memory), TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    try:
        while not s.conn.poll(1.0):
            if not s.proc.is_alive():
                raise _ended(s, "without answering")
            if time.monotonic() > deadline:
                raise TimeoutError(f"--side-processes: side {s.name!r}: its process did not answer in "
                                   f"{timeout:.0f} s")
        tag, payload = s.conn.recv()
    except (EOFError, ConnectionResetError):  # the process closed its end (ended) without a word, or was killed
        raise _ended(s, "without answering") from None  # with a request unread in its pipe (the socket's reset)
    if tag == "error":
        raise RuntimeError(f"side {s.name!r} failed in its process: {payload}")
    return payload


def spawn_sides(args, device: torch.device, mode_text: str, sides: list[Side], base: torch.nn.Module) -> None:
    """``--side-processes``: start one process per side of ``mode_text`` at once (spawned; each gets ``base`` with its
    weights shared, builds its side on them, compiles it and runs its first call, concurrently), wait for each to
    report, and fill in the sides (``proc``/``conn``, ``build_s``, ``first_s`` (the first call beside the others'
    compiles), ``second_ms`` (asked once every side is built), ``out``, ``fill_count``); :func:`_time_sides` then
    times them through their pipes. Raises as :func:`_recv` does (the first side to fail; :func:`stop_sides` ends
    the others)."""
    import multiprocessing
    from multiprocessing.connection import wait

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions that share base's weights

    ctx = multiprocessing.get_context("spawn")
    for s in sides:
        s.conn, theirs = ctx.Pipe()
        p = ctx.Process(target=_serve_side, args=(vars(args), str(device), mode_text, s.name, theirs, base,
                                                  os.getpid()), daemon=True)
        try:
            p.start()
        finally:
            theirs.close()
        s.proc = p  # only a started process (stop_sides joins it)
    pending = list(sides)
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while pending:
        wait([s.conn for s in pending] + [s.proc.sentinel for s in pending], timeout=1.0)
        for s in list(pending):
            if s.conn.poll() or not s.proc.is_alive() or time.monotonic() > deadline:
                r = _recv(s, max(0.0, deadline - time.monotonic()))
                pending.remove(s)
                s.build_s, s.first_s = r["build_s"], r["first_s"]
                s.out = None if r["out"] is None else torch.from_numpy(r["out"])
                s.fill_count = r["fill_count"]
    for s in sides:  # one more forward each, timed alone once no side compiles
        s.second_ms = _timed(s, device, 0, 1)


def stop_sides(sides: list[Side]) -> None:
    """End the sides' processes (asked; those still busy after 10 s, e.g. compiling when another side failed, are
    killed); a no-op for sides in this process."""
    any_cuda = torch.cuda.is_available() and any(s.proc is not None for s in sides)
    for s in sides:
        if s.proc is None:
            if s.conn is not None:  # its process never started
                s.conn.close()
                s.conn = None
            continue
        try:
            s.conn.send(("stop",))
        except (OSError, ValueError):
            pass
    end = time.monotonic() + 10.0
    for s in sides:
        if s.proc is None:
            continue
        s.proc.join(max(0.0, end - time.monotonic()))
        if s.proc.is_alive():
            s.proc.kill()
            s.proc.join(5)
        s.conn.close()
        s.proc = s.conn = None
    if any_cuda:  # the weights the stopped processes mapped, released on this (the producing) side too
        torch.cuda.ipc_collect()


def _fx_cache_counts() -> tuple[int, int, int, int]:
    """(hits, misses) of Inductor's FX graph cache, then of AOTAutograd's cache, in this process so far (a miss
    of AOTAutograd's includes a bypass: a graph it does not cache)."""
    from torch._dynamo.utils import counters

    aot = counters["aot_autograd"]
    return (counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"],
            aot["autograd_cache_hit"], aot["autograd_cache_miss"] + aot["autograd_cache_bypass"])


def precompile(args, device: torch.device) -> None:
    """``--compile-workers N``: every side of every compiled mode built and called once in child processes, up to N at
    a time (spawned, one per side: each loads the model, so each holds one copy of the weights on ``device``), so that
    torch's on-disk compile caches (Inductor's FX graph cache, AOTAutograd's, the Triton/C++ kernels; all shared
    through ``TORCHINDUCTOR_CACHE_DIR``, default under /tmp) hold what this process then compiles: its own compiles
    are mostly cache hits (Dynamo still traces each side; each mode's line says how many hit). Prints each child's
    time; a child that fails or dies (e.g. out of memory) is reported by its side and this process builds that side
    as usual. Skipped, saying so, where Inductor's FX graph cache is off."""
    import multiprocessing
    import queue
    from multiprocessing.connection import wait

    import torch._inductor.config as inductor_config

    if not getattr(inductor_config, "fx_graph_cache", True):
        print(f"--compile-workers {args.compile_workers}: Inductor's FX graph cache is off "
              "(TORCHINDUCTOR_FX_GRAPH_CACHE=0?), so nothing the workers compile would be reused; not precompiling",
              flush=True)
        return
    jobs = [(m, s.name) for m in args.bound_compile if parse_mode(m)[0] != "eager"
            for s in _sides_for(args, None, None)]
    n = min(args.compile_workers, len(jobs))
    print(f"precompiling {len(jobs)} sides in {n} child processes (--compile-workers {args.compile_workers})",
          flush=True)
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    running: dict = {}  # process -> (mode, side)
    reported = set()

    def report(item):
        mode_text, name, sec, err = item
        reported.add((mode_text, name))
        print(f"  [precompile] [{mode_text}] {name}: {sec:.1f} s" + (f", failed: {err}" if err else ""), flush=True)

    try:
        while jobs or running:
            while jobs and len(running) < n:
                job = jobs.pop(0)
                p = ctx.Process(target=_compile_one, args=(vars(args), str(device), *job, results), daemon=True)
                p.start()
                running[p] = job
            wait([p.sentinel for p in running], timeout=1.0)
            for p in [p for p in running if not p.is_alive()]:
                job = running.pop(p)
                p.join()
                try:  # its result is in the pipe once it has exited (its queue flushed at exit); others' may be first
                    while job not in reported:
                        report(results.get(timeout=2.0))
                except queue.Empty:
                    pass
                if job not in reported:  # died before reporting: killed (out of memory?) or crashed
                    print(f"  [precompile] [{job[0]}] {job[1]}: the child process ended with exit code {p.exitcode} "
                          "before reporting (killed, e.g. out of memory?); built here instead", flush=True)
    finally:
        for p in running:  # an interrupted run: no child left holding the device's memory
            p.kill()
            p.join(5)
    print(f"  [precompile] done in {time.perf_counter() - t0:.0f} s", flush=True)


def _run(args, device: torch.device, groups: dict) -> list[dict]:
    from .. import choose_mode
    from .bench import DTYPES, environment

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
    # diffusers' backend 'cp_ops' registered before any side compiles: registered by the first parallelize (after the
    # diffusers side compiled), it changed the backend registry that side's compiled blocks guard on, and the side
    # compiled its blocks again at its first timed call
    _private.register_backend(cp_ops_backend)
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
                fill_timing=("replayed alone in one CUDA graph: device time (since 2026-12-01e)" if device.type == "cuda"
                             else "replayed alone, launched back to back"),
                fake_outputs=_fake_outputs(written),
                side_processes=("every side of a compiled mode built, compiled and timed in its own process "
                                "(--side-processes), on this process's weights (shared, not copied), its forwards "
                                "when this process asks: one side's at a time" if remote else False))
    try:
        import diffusers

        meta["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    if only is None:
        print(f"cp-ops bound {args.model} --worlds {','.join(map(str, args.bound))}: {spec.cls} {config_name}, "
              f"{tokens} tokens (+{args.text_tokens} text), {args.dtype}, on {meta.get('gpu', 'CPU')}", flush=True)
    from .bench import _write_json

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
            first_calls.setdefault(mode_text, []).append(_first_call(s))
            if args.out:  # quietly: the mode's end says where it wrote
                _write_json(args.out, dict(meta=meta, rows=rows, profiles=profiles, first_calls=first_calls),
                            quiet=True)

        try:
            if remote:
                print(f"  [{mode_text}] {len(sides)} sides in their own processes (--side-processes), built at once "
                      "on this process's weights", flush=True)
                spawn_sides(args, device, mode_text, sides, base)
                for s in sides:
                    built(s, " (in its process, beside the others' compiles)")
            for s in sides if not remote else ():
                try:
                    _prepare(s, base, spec, kw, margs, device, groups, args)
                except Exception as e:  # noqa: BLE001 - diffusers' CP refusing is a row with its reason
                    if s.kind != "dcp":
                        raise
                    s.error, s.call = _reason(e), None
                    print(f"  [{mode_text}] {s.name}: failed: {s.error}", flush=True)
                    _reset_after_failure(base_mode, device)
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
                    s.fill_ms = _ask(s, ("fill",))
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
            if base_mode != "eager" and not remote:
                torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
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


def _fake_outputs(written: bool) -> str:
    """The run metadata's ``fake_outputs``: who writes the fake collectives' outputs."""
    if not written:
        return "unwritten (--unwritten)"
    return ("written: this rank's data in every slot of every data collective's output, one copy per output tensor "
            "(cp_ops.cli.bound_fill.FilledFakeGroup)")


def _first_call(s: Side) -> dict:
    """What the JSON's ``first_calls`` keeps of a side as soon as its first call returns (s, ms): written before the
    interleaved rounds, so a run killed by a time limit while other sides compile (a whole-model compile: minutes
    per side) still says how long each built side took to build and compile and what one forward took."""
    return dict(side=s.name, kind=s.kind, world_size=s.world, mode=s.mode, build_s=s.build_s, first_call_s=s.first_s,
                second_call_ms=s.second_ms)


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _reset_after_failure(base_mode: str, device) -> None:
    """After a side failed half-way (a compile error, an unwaited collective): free what it held."""
    if base_mode != "eager":
        torch._dynamo.reset()  # imported by run_bound (a local import here would make `torch` local: the eager
        # branch then raised UnboundLocalError on the GPU, 2026-12-01g)
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
        if s.kind == "dcp":  # diffusers' own CP: what it returned goes into its row (output_shape, outputs_finite)
            continue
        if s.out is None or tuple(s.out.shape) != tuple(ref.shape):
            raise RuntimeError(f"bound: side {s.name!r} returned shape {None if s.out is None else tuple(s.out.shape)}, "
                               f"expected the full output {tuple(ref.shape)}")
    for s in sides:
        if (s.kind in ("diffusers", "group1") or (filled and s.kind == "cp")) and not torch.isfinite(s.out).all():
            raise RuntimeError(f"bound: side {s.name!r} returned non-finite values")


#: the models' standard step counts (issue 21; diffusers pipelines' defaults): --steps N below it is extrapolated
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
    out = []
    for w in args.bound:
        cp = by[f"cp_ops W{w}"]
        net = cp.ms - cp.fill_ms  # the fake collectives' writes (stand-ins for the transfers) taken out
        row = dict(common, world_size=w, impl="cp_ops", mode=cp.mode, one_gpu_ms=one, one_gpu_from=best.name,
                   diffusers_ms=by["diffusers"].ms, rank0_ms=net, bound_speedup=_speedup(one, cp),
                   rank0_raw_ms=cp.ms, fill_ms=cp.fill_ms, fills=_fill_count(cp),
                   first_call_s=cp.first_s, rank0_samples=cp.samples, **_host(cp, steps=steps),
                   **_host(by["diffusers"], "diffusers_", steps), **_no_time_left(cp))
        if "group of 1" in by:
            row["group1_ms"] = by["group of 1"].ms
            row.update(_host(by["group of 1"], "group1_", steps))
        plain = by.get(f"plain W{w}")
        if plain is not None:  # both raw: each pays its stand-in writes (cp: the fake collectives'; plain: repeats)
            row.update(plain_ms=plain.ms, plain_fill_ms=plain.fill_ms, cp_ops_cost_ms=cp.ms - plain.ms,
                       cp_ops_cost_pct=100.0 * (cp.ms - plain.ms) / cp.ms, **_host(plain, "plain_", steps))
        rows = [row]
        for s in (x for x in sides if x.kind == "dcp" and x.world == w):  # diffusers' own CP beside cp_ops'
            if s.error is not None:
                rows.append(dict(common, world_size=w, impl=f"diffusers {s.mode}", mode=s.label or s.mode,
                                 skipped=s.error))
                continue
            d = s.ms - s.fill_ms
            shape_ok = s.out is not None and tuple(s.out.shape) == tuple(ref.shape)
            finite = bool(shape_ok and torch.isfinite(s.out).all())
            why = ([] if finite else ["the output is not finite or not the full shape: a collective's output was "
                                      "left unwritten (stale memory), so its kernels did not run on real data"]) \
                + list(_no_time_left(s).values())
            rows.append(dict(common, world_size=w, impl=f"diffusers {s.mode}", mode=s.label, one_gpu_ms=one,
                             one_gpu_from=best.name, diffusers_ms=by["diffusers"].ms, rank0_ms=d,
                             bound_speedup=_speedup(one, s),
                             rank0_raw_ms=s.ms, fill_ms=s.fill_ms, fills=_fill_count(s), first_call_s=s.first_s,
                             rank0_samples=s.samples, **_host(s, steps=steps), output_shape_ok=shape_ok,
                             outputs_finite=finite,
                             **({"invalid": "; ".join(why)} if why else {}),
                             **({} if base_mode == "eager" else dict(fullgraph=s.fullgraph)),
                             **({"fullgraph_error": s.fullgraph_error} if s.fullgraph_error else {})))
        if steps:
            for r in rows:
                if "skipped" not in r:
                    _add_steps(r, steps, by, args.model)
        out += rows
    return out


def _fill_count(s: Side) -> int:
    """How many fake-collective writes one forward of ``s`` makes (counted in its process with --side-processes)."""
    return len(s.fills) if s.fill_count is None else s.fill_count


def _host(side: Side, prefix: str = "", steps: int = 0) -> dict:
    """``{prefix + 'host_ms', prefix + 'host_bound'}`` of ``side`` (the host's time to enqueue one forward, and whether
    it reaches :data:`HOST_BOUND` of the side's measured time ``ms``); ``{}`` where not timed, and for a ``steps``
    loop (it reads its per-step CUDA events at its end, so its call waits for the device: host = wall)."""
    if side.host_ms is None or steps:
        return {}
    return {prefix + "host_ms": side.host_ms, prefix + "host_bound": side.host_bound}


def _speedup(one: float, side: Side) -> float | None:
    """The bound of ``side``: the 1-device time / its time less its fill copies; None where nothing is left."""
    net = side.ms - side.fill_ms
    return one / net if net > 0 else None


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
    side = by["cp_ops W%d" % row["world_size"]] if row["impl"] == "cp_ops" else \
        by[f"{row['impl']} W{row['world_size']}"]
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
    has_impl = any(r.get("impl", "cp_ops") != "cp_ops" for r in rows)  # --compare diffusers
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
        cost = (f"{r['cp_ops_cost_ms']:>7.2f} ms {r['cp_ops_cost_pct']:>5.1f}%" if "cp_ops_cost_ms" in r else "")
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
        print("impl 'diffusers ulysses|ring' = diffusers' own CP (enable_parallelism) over the same fake group, its "
              "all-to-alls written like cp_ops' (cp_ops.cli.bound_fill); its bound beside cp_ops'.")
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
