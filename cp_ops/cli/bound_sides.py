"""The sides of ``cp-ops bound``: the model variants timed against each other (:class:`Side`), how each is built
(a weight-sharing copy, parallelized over a fake group, with plain attention for ``--cost``), compiled, called,
timed in interleaved rounds and profiled; the compile modes (:func:`parse_mode`)."""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from ..integrations.diffusers.dispatch import CPAttention
from ..kernels.sdpa import CUDA_PRIORITY
from ..timing import Graphed, time_ms
from . import bound_fill
from ._args import whole_capture
from .run import _sync


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


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model``'s module tree (own hooks, processors, forwards) whose parameters and buffers ARE
    ``model``'s (no weight memory): what :func:`cp_ops.integrations.diffusers.parallelize` and regional compilation
    modify is per module, never a weight."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


class PlainAttention(CPAttention):
    """Stands in for cp_ops' attention in the ``plain W`` side: plain SDPA of the shapes rank 0 of the mode computes,
    with no cp_ops code (no host path, no collective), copies standing in for the transfers' writes. AGKV: local Q
    against K/V of all S tokens (the local block repeated, cut to S); Ulysses: Q, K, V of all S tokens and ``H / W``
    heads, the output's first ``S_local`` tokens repeated over the heads. A key-padding mask is repeated like K.
    Output ``[B, S_local, H, D]``; its values are not the model's: a timing stand-in only."""

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
    """BSHD SDPA in :func:`cp_ops.local_attention`'s CUDA backend order, through torch's own ``sdpa_kernel``."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel(CUDA_PRIORITY, set_priority=True) if q.is_cuda else contextlib.nullcontext():
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
    kind: str  # 'diffusers' | 'group1' | 'cp' | 'plain' | 'dcp' (a peer's own CP, --compare: bound_peers)
    world: int
    mode: str | None = None  # the CP attention mode (cp / plain sides); dcp: the layout ('ulysses' | 'ring')
    peer: str = "diffusers"  # dcp: the library (a name of cp_ops.cli.bound_peers.PEERS)
    around: Callable | None = None  # dcp: a context manager factory each of its calls runs inside (bound_peers)
    call: Callable[[], object] | None = None
    first_s: float = 0.0
    build_s: float = 0.0  # building the side's model before its first call (copy, parallelize, compile wrappers)
    second_ms: float | None = None  # one forward right after the first call, timed alone (a killed run keeps it)
    samples: list = field(default_factory=list)
    host_samples: list = field(default_factory=list)  # per sample: the median host time of its forwards (ms)
    out: torch.Tensor | None = None
    fills: list = field(default_factory=list)  # one forward's fake collective writes (bound_fill.recording)
    fill_ms: float = 0.0  # their device time, replayed alone (bound_fill.replay_ms)
    label: str | None = None  # dcp: what the peer ran (diffusers: 'ulysses', 'ulysses_anything', 'ring')
    error: str | None = None  # dcp: why the side could not run (a row with the reason; the others still run)
    step_ms: list = field(default_factory=list)  # --steps: the last timed loop's per-step times
    fullgraph: bool = True  # compiled whole (every side) or, a dcp side Dynamo cannot, with graph breaks
    fullgraph_error: str | None = None  # dcp: why fullgraph=True failed
    proc: object = None  # --side-processes: the process that holds and times this side (its pipe: ``conn``)
    conn: object = None
    fill_count: int | None = None  # --side-processes: len(fills) in the side's process (the copies stay there)
    ask: Callable | None = None  # --side-processes: ask(request) -> the side's process's answer (bound_procs._ask)

    @property
    def ms(self) -> float:
        return statistics.median(self.samples)

    @property
    def host_ms(self) -> float | None:
        """The host's time to enqueue one forward (median over the samples of each sample's median), ms."""
        return statistics.median(self.host_samples) if self.host_samples else None

    @property
    def host_bound(self) -> bool | None:
        """Enqueuing a forward takes >= :data:`HOST_BOUND` of its measured time (the device waited for the host)."""
        h = self.host_ms
        return None if h is None else h >= HOST_BOUND * self.ms


def _make_call(m, spec, kw, margs, device, count=None, step_log=None, around=None):
    """The side's call: one forward, or with ``margs.steps`` a denoising loop (:func:`cp_ops.cli.run.denoise`; its
    per-step ms into ``step_log``). ``count[0]`` += 1 per Python-level call; ``around()``: a context manager each
    call runs inside (a peer's process-wide state); eager+graphs and +capture: captured."""
    from .run import _forward_fn, denoise

    if margs.steps:
        def fwd():
            lat, ms = denoise(m, spec, kw, margs.steps, device, margs)
            if step_log is not None:
                step_log[:] = ms
            return lat
    else:
        fwd = _forward_fn(m, spec, kw, margs)
    if around is not None:
        bare = fwd

        def fwd():
            with around():
                return bare()
    if count is not None:
        inner = fwd

        def fwd():
            count[0] += 1
            return inner()
    if whole_capture(margs):  # eager+graphs, regional/full+capture: the whole forward in one graph
        return Graphed(fwd, device)
    return fwd


def _prepare(side: Side, base, spec, kw, margs, device, groups, args) -> None:
    """Build ``side``'s model (a shared copy of ``base``, parallelized for group1/cp/plain, a peer's CP for dcp),
    compile it as ``margs`` says, run and time its first call (``side.call``, ``first_s``, ``out``). A dcp side Dynamo
    cannot compile whole is built again with graph breaks (``fullgraph=False``; ``side.fullgraph_error`` says why)."""
    try:
        return _build_and_run(side, base, spec, kw, margs, device, groups, args, fullgraph=True)
    except Exception as e:  # noqa: BLE001 - diffusers' CP under Dynamo: retried with graph breaks, the reason kept
        if side.kind != "dcp" or not margs.compile:
            raise
        side.fullgraph_error = _reason(e)
        print(f"  {side.name}: fullgraph=True failed ({side.fullgraph_error[:160]}); compiling with graph breaks",
              flush=True)
    gc.collect()
    return _build_and_run(side, base, spec, kw, margs, device, groups, args, fullgraph=False)


def _build_and_run(side: Side, base, spec, kw, margs, device, groups, args, fullgraph: bool) -> None:
    from ..integrations.diffusers import capture_safe, parallelize
    from . import bound_peers
    from .run import compile_model

    t_build = time.perf_counter()
    m = shared_copy(base)
    if whole_capture(margs):  # diffusers code a capture refuses, replaced by equivalents (every side alike)
        capture_safe.apply(m)
    eager_fills = None
    if side.kind == "dcp":
        built = bound_peers.parallelize(side.peer, m, side.mode, groups[side.world], spec.heads(base.config), device,
                                        kw)
        side.label, side.around = built.label, built.around
        if whole_capture(margs):  # the peer's class may call diffusers' functions through its own module's names
            capture_safe.apply(m)
        if margs.compile:  # compiled, the peer's collectives are traced: the writes are recorded from one eager call
            eager = SimpleNamespace(compile=None, cuda_graphs=False, no_overlap=False, steps=margs.steps, cfg=False)
            with bound_fill.recording() as eager_fills:
                _make_call(m, spec, kw, eager, device, around=side.around)()
    elif side.kind != "diffusers":
        parallelize(m, groups[side.world], mode=side.mode, transport="torch", chunks=args.chunks,
                    cuda_graphs=False)  # the bound compiles and captures every side alike itself
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
        call = _make_call(m, spec, kw, margs, device, count, side.step_ms, side.around)
        out = call()
    _sync(device)
    side.first_s = time.perf_counter() - t0
    # eager+graphs, +capture: warm-up and capture forwards, identical (compiled: the first warm-up compiles)
    side.fills = list(eager_fills) if eager_fills is not None else rec[: len(rec) // max(1, count[0])]
    side.call = call
    side.out = out.detach().float().cpu() if isinstance(out, torch.Tensor) else None


def _time_sides(sides: list[Side], device, warmup: int, rounds: int) -> None:
    """``warmup`` untimed forwards of each side, then ``rounds`` interleaved rounds of one sample of every side: the
    median of ``n`` waited-for forwards (a sample lasts ~SAMPLE_MS) and of their host times (wall, not waited for)."""
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
    ms, hosts = s.ask(("time", warmup, n))
    if host is not None:
        host.extend(hosts)
    return ms


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
