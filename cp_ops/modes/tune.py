"""The choice of a CP attention variant for ``mode='auto'`` and/or ``chunks=None`` (issue 9 item 4; issue 19 item
3): the pure decision. It takes a runner from its caller and keeps no cache of its own: what was chosen is kept by
:mod:`cp_ops.choices` (memory, the cache file, the ranks' agreement on cached entries), which
:mod:`cp_ops.dispatch` owns.

An explicit mode *and* an explicit chunk count are the caller's (:func:`choose` returns them, source 'explicit').
Otherwise the candidates are every variant the request leaves open (:func:`candidates`: modes 'agkv' and 'ulysses' —
Ulysses only where W divides H — for ``mode='auto'``, else the named mode; chunk counts :data:`CHUNKS` = 1, 2, 4 for
``chunks=None``, else the given count; variants that run the same schedule are listed once), and:

* unmeasured (measuring off — ``CP_OPS_TUNE_MODES=0``, the default —, a group of one rank or of the 'fake' backend,
  code traced by ``torch.compile``, a call inside CUDA-graph capture): the heuristic (:func:`heuristic`) —
  :func:`cp_ops.modes.choose` for the mode (AGKV at W = 2; from W = 3 Ulysses when W divides H, else AGKV) and
  :func:`cp_ops.modes.pipelined.choose_chunks` for the stages (a table keyed by mode and the transport the call runs
  on, 'auto' resolved for the group: AGKV on the fast transport 2, else 1; see its docstring for the measurements
  behind it). No timing: the same inputs give the same variant, hence the same outputs, from run to run, whatever
  the load on the machine (as ``torch.backends.cudnn.benchmark = False``). Measured choices differ with load
  (pipelined or not: ~5e-3 relative in bf16), so measuring is opt-in. Measuring at trace time was tried through
  :func:`torch.compiler.assume_constant_result`; Dynamo cannot pass it symbolic sizes (automatic dynamic shapes after
  a recompile) and fails the trace, so a traced call takes the heuristic; pass ``mode=``/``chunks=`` explicitly
  (e.g. what :func:`cp_ops.describe` reports after an eager call) to compile the measured variant.
* one candidate left (e.g. ``mode='agkv', chunks=None`` at W = 2 on a shape whose stage plans coincide): that one
  (source 'single').
* measuring on (``CP_OPS_TUNE_MODES=1``, or ``cp_ops.config.configure(tune_modes=True)`` on every rank), several
  candidates: :func:`choose` returns them (an :class:`Open` request); the caller takes a choice it stored (the cache
  every rank holds alike) or has :func:`measured` time them with its ``runner`` (:func:`measure`): every rank runs
  every candidate, through ``runner(mode, chunks)`` (:data:`Runner`; the dispatcher's runs :func:`cp_ops.attention`
  on synthetic random tensors of the call's shape and dtype, :func:`cp_ops.dispatch.runner`):

  1. :data:`WARMUP` untimed calls per candidate, then one timed call each to size the samples (max over ranks);
  2. rounds of samples, interleaved: each round times every candidate once, in candidate order (A B C A B C
     ...), so drift over the measurement (clocks, temperature, first-use effects, other work on the machine)
     hits every candidate alike instead of whichever ran first. A sample is n back-to-back calls between two
     CUDA events (``time.perf_counter`` on CPU) divided by n, n chosen so it lasts about :data:`SAMPLE_MS`
     (1 ≤ n ≤ :data:`MAX_CALLS`). Rounds: as many as fit in :data:`BUDGET_MS`, at least :data:`MIN_ROUNDS`,
     at most :data:`ROUNDS`;
  3. each candidate's time is the median of its samples, max-reduced over the group (the slowest rank's time
     is the call's), so every rank holds the same vector;
  4. :func:`pick` with the margin rule: among the candidates whose time is within :data:`MARGIN` (3 %) of the
     fastest, the heuristic's candidate (:func:`heuristic_candidate`: the (mode, chunks) measuring-off would
     run) if it is one of them; else the simplest of them (fewer chunks; at equal chunks, the heuristic's mode;
     then candidate order). A candidate other than the heuristic's is chosen only if it is faster by more than
     the margin. A deterministic function of the shared vector and the call, so every rank picks the same
     candidate. Why a margin: on 2x H200 (S=4096, torch transport) a pick by the bare minimum of 3 samples chose
     agkv chunks=2 (0.615 ms in the bench) over chunks=1 (0.469 ms). Why the heuristic's candidate first: within
     the run-to-run spread the tie goes to what the bench measured faster across the S range; at 32K (fast
     AGKV) the tuner measured chunks 1 and 2 within 0.2 % (18.68 vs 18.65 ms) and, preferring the simplest, kept
     chunks=1, while the explicit chunks=2 row ran 4 % faster in the same run (2026-11-30c; see
     :func:`cp_ops.modes.pipelined.choose_chunks`).

  First-call cost per decision (c candidates, t = one call's time): about c·(WARMUP + 1)·t of warm-up and
  sizing plus the timed rounds, ≤ max(:data:`BUDGET_MS`, :data:`MIN_ROUNDS`·c·(SAMPLE_MS + t)). At 2 GPUs,
  S_local=2048, H=40, D=128 (6 candidates, t ≈ 0.5 ms): 20 calls a sample, 7 rounds of 60 ms, about 0.42 s
  timed; for a call of 30 ms, 3 rounds, about 0.55 s timed plus 0.55 s of warm-up and sizing.

Module state: the timing constants below and the :data:`_timer` hook (tests replace it); no record of past choices.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ..timing import max_over_ranks_each, steady_ms
from . import names as mode_names
from . import spec as mode_spec
from .agkv_pipelined import stage_plan
from ..transport.base import concrete_name
from .pipelined import choose_chunks

#: Chunk counts tried for ``chunks=None``.
CHUNKS = (1, 2, 4)
#: Untimed calls per candidate (plans, transport tuning, allocator) before timing.
WARMUP = 2
#: Most rounds of timed samples (one sample per candidate per round; the median per candidate is taken).
ROUNDS = 7
#: Fewest rounds, whatever :data:`BUDGET_MS` says.
MIN_ROUNDS = 3
#: Target length of one sample, ms (n back-to-back calls, 1 ≤ n ≤ :data:`MAX_CALLS`).
SAMPLE_MS = 10.0
MAX_CALLS = 20
#: Time budget of the timed rounds of one decision, ms (estimated from the sizing call; see the module docstring).
BUDGET_MS = 500.0
#: A more complex candidate must be faster than a simpler one by more than this fraction to be chosen over it.
MARGIN = 0.03

#: Where a choice came from (:attr:`Choice.source`).
SOURCES = ("explicit", "heuristic", "single", "measured", "cached", "pending")


class Choice(NamedTuple):
    """A decision for one request: the variant (``mode``, ``chunks``), where it came from (``source``, one of
    :data:`SOURCES`: 'explicit' (the caller's mode and chunks), 'heuristic', 'single' (one candidate left),
    'measured' (timed now), 'cached' (the stored choice every rank holds alike, :mod:`cp_ops.choices`), 'pending'
    (only :func:`cp_ops.describe`: measuring is on and the first call has not measured yet; ``mode``/``chunks`` are
    the heuristic's until then)), the candidates' times in ms — median of the samples on each rank, max over the
    ranks (``{'agkv/2': 0.9, ...}``; empty unless measured or cached) —, the transport the call runs on ('torch',
    'fast'; 'auto' where the group has not agreed on it yet; filled by :func:`cp_ops.describe`, '' elsewhere) and
    ``why``, the reason in words."""

    mode: str
    chunks: int
    source: str
    times_ms: dict
    transport: str = ""
    why: str = ""


class Open(NamedTuple):
    """A request that measuring decides: its candidates (:func:`candidates`, in measuring order) and the heuristic's
    candidate (:func:`heuristic_candidate`, which :func:`pick` prefers within the margin)."""

    candidates: list
    preferred: tuple


#: ``runner(mode, chunks) -> run``: ``run()`` makes one call of the candidate (a collective: every rank calls it
#: alike), on tensors of the decided call's shape, dtype and device.
Runner = Callable[[str, int], Callable[[], object]]


def choose(mode: str, chunks: int | None, chosen: str, shape, pg: dist.ProcessGroup, device, transport: str,
           measuring: bool) -> Choice | Open:
    """The decision for a request on W ranks, short of timing (see the module docstring).

    Args:
        mode, chunks: as the caller passed them (``'auto'`` / ``None`` = open). chosen: ``cp_ops.modes.choose(mode, H,
            W)`` (checked). shape: ``[B, S_local, H, D]`` of this rank's q. pg: the CP group. device: q's device.
            transport: the resolved transport ('torch', 'fast', or 'auto': resolved for the group by
            :func:`cp_ops.transport.base.concrete_name`, collective the first time). measuring: the caller's
            setting (``settings.tune_modes``).
    Returns:
        a :class:`Choice` (source 'explicit', 'heuristic' or 'single'), or an :class:`Open` request: measuring is on
        and several candidates are left (the caller measures with :func:`measured`, or takes a choice it stored).
    Raises:
        RuntimeError: ``transport`` 'auto' and the group did not agree on one within ``CP_OPS_TIMEOUT_S``.
    """
    if mode != "auto" and chunks is not None:
        return Choice(chosen, chunks, "explicit", {}, why="mode and chunks given by the caller")
    w = pg.size()
    if torch.compiler.is_compiling():
        return heuristic(chunks, chosen, shape, pg, device, transport, "traced by torch.compile: measuring is eager only")
    if w == 1:
        return heuristic(chunks, chosen, shape, pg, device, transport, "a group of one rank")
    from ..group import backend_name

    if backend_name(pg) == "fake":
        return heuristic(chunks, chosen, shape, pg, device, transport, "a 'fake' process group (nothing runs)")
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        return heuristic(chunks, chosen, shape, pg, device, transport, "inside CUDA-graph capture")
    if not measuring:
        return heuristic(chunks, chosen, shape, pg, device, transport, "measuring off (CP_OPS_TUNE_MODES=0, the default)")
    cands = candidates(mode, chunks, shape[2], w)
    if len(cands) == 1:
        return Choice(cands[0][0], cands[0][1], "single", {}, why="the only candidate the request leaves open")
    return Open(cands, heuristic_candidate(chunks, chosen, shape, pg, device, transport))


def measured(request: Open, chosen: str, shape, dtype, device, pg: dist.ProcessGroup, transport: str,
             runner: Runner | None) -> Choice:
    """Time ``request``'s candidates with the caller's ``runner`` (:func:`measure`) and :func:`pick` one: a Choice
    with source 'measured' and every candidate's time. Collective: every rank of ``pg`` calls it alike.

    Raises:
        ValueError: no runner. RuntimeError: a rank did not take part within ``CP_OPS_TIMEOUT_S``."""
    cands = request.candidates
    times = measure(cands, shape, dtype, device, pg, transport, runner)
    best = pick(cands, times, chosen, preferred=request.preferred)
    named = {f"{m}/{c}": t for (m, c), t in zip(cands, times)}
    return Choice(cands[best][0], cands[best][1], "measured", named,
                  why=f"measured: the fastest of {len(cands)} candidates beyond a {MARGIN:.0%} margin "
                      "(the heuristic's candidate within it)")


def candidates(mode: str, chunks: int | None, heads: int, world_size: int) -> list[tuple[str, int]]:
    """The variants a request leaves open, in measuring order (the last tie-break of :func:`pick`): ``[(mode,
    chunks), ...]``. Variants that run the same schedule (Ulysses head sub-groups capped at H/W; AGKV stage
    plans that coincide) appear once."""
    if mode == "auto":
        ms = [m for m in ("agkv", "ulysses") if m in mode_names(False)
              and not (mode_spec(m).needs_heads_divisible and heads % world_size)]
    else:
        ms = [mode]
    out = []
    for m in ms:
        seen = set()
        for c in (CHUNKS if chunks is None else (chunks,)):
            if c == 1:
                sched = 1
            elif m == "ulysses":
                g = max(1, min(c, heads // world_size))
                sched = 1 if g == 1 and chunks is None else ("g", g)
            else:
                sched = stage_plan(world_size, c)
            if sched not in seen:
                seen.add(sched)
                out.append((m, c))
    return out


def heuristic_candidate(chunks, chosen, shape, pg, device, transport) -> tuple[str, int]:
    """The ``(mode, chunks)`` the heuristic gives a request: ``chosen`` (:func:`cp_ops.modes.choose`) and the given
    ``chunks``, or for ``chunks=None`` :func:`cp_ops.modes.pipelined.choose_chunks` on the transport the call runs
    on (``transport`` 'auto' resolved for the group by :func:`cp_ops.transport.base.concrete_name`)."""
    if chunks is not None:
        return chosen, chunks
    return chosen, choose_chunks(chosen, pg.size(), _Shape(shape), concrete_name(transport, pg.group_name, device))


def heuristic(chunks, chosen, shape, pg, device, transport, reason: str) -> Choice:
    """:func:`heuristic_candidate` as a :class:`Choice` (source 'heuristic'), ``why`` naming ``reason`` (why nothing
    is measured)."""
    m, c = heuristic_candidate(chunks, chosen, shape, pg, device, transport)
    return Choice(m, c, "heuristic", {}, why=f"the heuristic: {reason}")


class _Shape:
    """A stand-in with ``.shape`` for :func:`choose_chunks` (which reads only the shape)."""

    def __init__(self, shape):
        self.shape = torch.Size(shape)


def pick(cands: list[tuple[str, int]], times: list[float], default_mode: str, margin: float | None = None,
         preferred: tuple[str, int] | None = None) -> int:
    """The index of the chosen candidate among those within ``margin`` (default :data:`MARGIN`) of the fastest,
    i.e. no candidate is faster than it by more than ``margin`` of its time (``min(times) >= times[i] * (1 -
    margin)``): ``preferred`` (the heuristic's candidate for the call, :func:`heuristic_candidate`) when it is
    among them; else the simplest of them.

    Simpler: fewer chunks; at equal chunks, ``default_mode`` (the heuristic's mode, :func:`cp_ops.modes.choose`)
    before another; then the earlier in ``cands``. A pure function of its arguments: ranks holding the same
    max-reduced ``times`` (and the same ``preferred``, which every rank derives alike) pick the same index.
    """
    m = MARGIN if margin is None else margin
    fastest = min(times)
    ok = [i for i, t in enumerate(times) if fastest >= t * (1.0 - m)]
    if preferred is not None:
        for i in ok:
            if tuple(cands[i]) == tuple(preferred):
                return i
    return min(ok, key=lambda i: (cands[i][1], cands[i][0] != default_mode, i))


def measure(cands, shape, dtype, device, pg, transport, runner: Runner | None = None) -> list[float]:
    """Each candidate's time per call in ms: the median of its interleaved samples on this rank, max over the
    ranks of ``pg`` (the same list on every rank; see the module docstring for the schedule and its budget).
    Every rank makes the same calls (the sizes come from max-reduced estimates): each call is a collective.

    ``runner(mode, chunks)`` gives the zero-argument call timed for each candidate (:data:`Runner`, given by the
    caller: :func:`cp_ops.dispatch.runner`), made once per candidate before timing.

    Raises:
        ValueError: no runner (this module makes no call of its own: it takes one from its caller)."""
    if runner is None:
        raise ValueError("tune.measure needs a runner(mode, chunks) from its caller (cp_ops.dispatch.runner)")
    runs = [runner(m, c) for m, c in cands]
    for run in runs:
        for _ in range(WARMUP):
            run()
    est = max_over_ranks_each([_timer(cand, run, device, 1) for cand, run in zip(cands, runs)], device, pg)
    calls, rounds = schedule(est)
    samples: list[list[float]] = [[] for _ in cands]
    for _ in range(rounds):  # interleaved: A B C A B C ...
        for i, (cand, run) in enumerate(zip(cands, runs)):
            samples[i].append(_timer(cand, run, device, calls[i]))
    return max_over_ranks_each([statistics.median(s) for s in samples], device, pg)


def schedule(est_ms: list[float]) -> tuple[list[int], int]:
    """``(calls per sample for each candidate, rounds)`` from the candidates' estimated ms per call (max over
    ranks, so every rank gets the same): calls = ceil(:data:`SAMPLE_MS` / est) within [1, :data:`MAX_CALLS`];
    rounds = the number of rounds that fit in :data:`BUDGET_MS`, within [:data:`MIN_ROUNDS`, :data:`ROUNDS`]."""
    calls = [max(1, min(MAX_CALLS, math.ceil(SAMPLE_MS / max(e, 1e-3)))) for e in est_ms]
    per_round = sum(n * max(e, 1e-3) for n, e in zip(calls, est_ms))
    rounds = max(MIN_ROUNDS, min(ROUNDS, int(BUDGET_MS // per_round)))
    return calls, rounds


def _sample_ms(cand: tuple[str, int], run: Callable[[], object], device: torch.device, calls: int) -> float:
    """One sample of candidate ``cand`` on this rank: ``calls`` runs of ``run()`` back to back, ms per call
    (:func:`cp_ops.timing.steady_ms`)."""
    del cand
    return steady_ms(run, device, 0, 1, calls)[0]


#: How one sample is timed on this rank: ``fn(cand, run, device, calls) -> ms per call`` (tests replace it; the
#: sizing call is ``calls=1``).
_timer = _sample_ms
