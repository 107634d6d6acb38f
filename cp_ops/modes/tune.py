"""The measured choice of a CP attention variant: ``mode='auto'`` and/or ``chunks=None`` (issue 9, item 4).

:func:`cp_ops.attention` calls :func:`decide` with what the caller asked for. An explicit mode *and* an explicit
chunk count are returned unchanged. Otherwise the candidates are every variant the request leaves open
(:func:`candidates`: modes 'agkv' and 'ulysses' — Ulysses only where W divides H — for ``mode='auto'``, else
the named mode; chunk counts :data:`CHUNKS` = 1, 2, 4 for ``chunks=None``, else the given count; variants that
run the same schedule are listed once), and:

* ``settings.tune_modes`` off (the default; ``CP_OPS_TUNE_MODES=0``): the heuristic — :func:`cp_ops.modes.choose`
  for the mode (AGKV at W = 2; from W = 3 Ulysses when W divides H, else AGKV) and
  :func:`cp_ops.modes.pipelined.choose_chunks` for the stages (a table keyed by mode and the transport the call
  runs on, 'auto' resolved for the group: AGKV on the fast transport 2, else 1; see its docstring for the
  measurements behind it). No timing, no file: the same inputs give the same variant, hence the same outputs,
  from run to run, whatever the load on the machine (as ``torch.backends.cudnn.benchmark = False``). Measured
  choices differ with load (pipelined or not: ~5e-3 relative in bf16), so measuring is opt-in.
* on (``CP_OPS_TUNE_MODES=1``, or ``cp_ops.config.configure(tune_modes=True)`` on every rank): a measured
  candidate, measured on first use per (CP group, W, B, S_local, H, D, dtype, device, transport, request) and
  then a dict lookup (about 1 µs); kept in the disk cache below, so a later process with the same cache makes
  the same choice without timing (deterministic once cached). Measuring (:func:`measure`): every rank runs
  every candidate on synthetic random tensors of the call's shape and dtype (the call's data is not needed),
  through ``runner(mode, chunks)`` (default: :func:`cp_ops.attention` with the candidate's explicit mode and
  chunks; a caller may pass its own, see :func:`decide`):

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

Disk cache (measuring on only; nothing is read or written with it off): the choices (with their measured times)
are kept in a JSON file, ``settings.tune_cache``
(``CP_OPS_TUNE_CACHE``; default ``$XDG_CACHE_HOME/cp_ops/choices.json``, ``~/.cache/...`` without it; ``off``: no
file), keyed by the machine (GPU model and driver version, or the CPU), the torch and cp_ops versions, the call,
:data:`MARGIN` and the heuristic's candidate. Format :data:`FORMAT` = 3 since the pick prefers the heuristic's
candidate within the margin (format 2: the simplest; format 1: the bare minimum of 3 samples, before the
interleaved rounds and the margin): a file of another format is ignored, its requests measured again and the
file rewritten in format 3. A rank cannot trust its own file alone (a rank with a stale or missing file would skip
measuring while its peers measure, and the collectives would mismatch): on first use the ranks exchange which cached candidate each
holds (one all-reduce over the group) and use it only when every rank holds the same one; otherwise all
measure and every rank rewrites its entry. A file that does not parse (bad JSON, nesting too deep for the
parser: ``RecursionError``) or whose entries have wrong types (:func:`_valid_entry`) is ignored, in whole or
those entries, with a warning naming the file, on the rank holding it: that rank then holds no cached candidate,
so every rank measures alike (no rank raises while its peers wait). An unwritable file is reported once (a
warning); neither stops the call.

Before its first collective a measuring rank compares the collective settings over the group
(:func:`cp_ops.contract.check_settings_agree`; ``tune_modes`` is one of :data:`cp_ops.config.COLLECTIVE_FIELDS`):
a peer with measuring off meets that exchange with its op's own, and both raise ValueError naming the setting
instead of hanging. With measuring off no exchange is added.

Not measured (the heuristic decides): a group of one rank, or of the 'fake' backend (tracing tests), a first
call inside CUDA-graph capture, and code traced by ``torch.compile`` (measuring at trace time was tried through
:func:`torch.compiler.assume_constant_result`; Dynamo cannot pass it symbolic sizes — automatic dynamic shapes
after a recompile — and fails the trace, so a traced call takes the heuristic; pass ``mode=``/``chunks=``
explicitly, e.g. what :func:`describe` reports after an eager call, to compile the measured variant).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import warnings
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from .. import config
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
#: Format of the disk cache; a file of another format is ignored (and replaced on the next write).
FORMAT = 3


class Choice(NamedTuple):
    """A decision: the variant, where it came from ('measured', 'disk', 'heuristic', 'explicit', 'single'
    (one candidate)), the candidates' times in ms, median of the samples on each rank, max over the ranks
    ({'agkv/2': 0.9, ...}; empty unless measured or read from disk)."""

    mode: str
    chunks: int
    source: str
    times_ms: dict


#: Counters for tests and reports: 'measured' (decisions measured), 'timed' (candidates timed), 'disk' (decisions
#: taken from the disk cache), 'heuristic'.
stats = {"measured": 0, "timed": 0, "disk": 0, "heuristic": 0}
_memo: dict[tuple, tuple] = {}  # (group, request, shape, dtype, device, transport, tune_modes) -> (mode, chunks)
_choices: dict[tuple, "Choice"] = {}  # the same key -> the Choice (source, times) for reports
_warned: set[tuple[str, str]] = set()


#: ``runner(mode, chunks) -> run``: ``run()`` makes one call of the candidate (a collective: every rank calls it
#: alike), on tensors of the decided call's shape, dtype and device.
Runner = Callable[[str, int], Callable[[], object]]


def decide(mode: str, chunks: int | None, chosen: str, q: torch.Tensor, group: dist.ProcessGroup,
           transport: str, runner: Runner | None = None) -> tuple[str, int]:
    """``(mode, chunks)`` for a call of :func:`cp_ops.attention` on W > 1 ranks (see the module docstring).

    Args:
        mode, chunks: as the caller passed them (``'auto'`` / ``None`` = open). chosen: ``modes.choose(mode,
            H, W)`` (checked). q: this rank's ``[B, S_local, H, D]`` (only shape, dtype, device are read). group: the CP group. transport: the resolved transport ('torch', 'fast').
        runner: what :func:`measure` times when measuring is on and the choice is not cached (see :data:`Runner`);
            required where measuring runs (the dispatcher gives :func:`cp_ops.dispatch.runner`).
    Returns:
        the mode name and the chunk count (≥ 1) every rank of the group uses.
    Raises:
        ValueError: the ranks' collective settings differ (first use only; raised on every rank).
        RuntimeError: a rank did not take part within ``CP_OPS_TIMEOUT_S`` (first use only).
    """
    if mode != "auto" and chunks is not None:
        return chosen, chunks
    if torch.compiler.is_compiling():  # traced by torch.compile: the heuristic (see the module docstring)
        return heuristic_candidate(chunks, chosen, q.shape, group, q.device, transport)
    hit = _memo.get((group, mode, chunks, q.shape, q.dtype, q.device, transport, config.settings.tune_modes))
    if hit is not None:  # the cached choice: one dict lookup
        return hit
    return _decide(mode, chunks, chosen, tuple(q.shape), q.dtype, str(q.device), group.group_name, transport, runner)


def _decide(mode, chunks, chosen, shape, dtype, device, group_name, transport, runner=None) -> tuple[str, int]:
    """:func:`decide` on plain values, after a miss of the eager cache."""
    pg = _resolve(group_name)
    key = (pg, mode, chunks, torch.Size(shape), dtype, torch.device(device), transport, config.settings.tune_modes)
    hit = _memo.get(key)
    if hit is not None:
        return hit
    c = _choose(mode, chunks, chosen, shape, dtype, torch.device(device), pg, transport, runner)
    if c is not None:
        _memo[key] = (c.mode, c.chunks)
        _choices[key] = c
        return c.mode, c.chunks
    return _choose_heuristic_only(chunks, chosen, shape, pg, device, transport)


def describe(mode: str, chunks: int | None, q: torch.Tensor, group: dist.ProcessGroup, transport: str) -> Choice | None:
    """The :class:`Choice` :func:`decide` made for this request on ``group`` (None before it made one): what
    ``cp-ops bench --modes auto`` reports."""
    return _choices.get((group, mode, chunks, q.shape, q.dtype, q.device, transport, config.settings.tune_modes))


def _resolve(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


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


def _choose_heuristic_only(chunks, chosen, shape, pg, device, transport) -> tuple[str, int]:
    c = _heuristic(chunks, chosen, shape, pg, device, transport)
    return c.mode, c.chunks


def heuristic_candidate(chunks, chosen, shape, pg, device, transport) -> tuple[str, int]:
    """The ``(mode, chunks)`` the heuristic gives a request: ``chosen`` (:func:`cp_ops.modes.choose`) and the given
    ``chunks``, or for ``chunks=None`` :func:`cp_ops.modes.pipelined.choose_chunks` on the transport the call runs
    on (``transport`` 'auto' resolved for the group by :func:`cp_ops.transport.base.concrete_name`)."""
    if chunks is not None:
        return chosen, chunks
    return chosen, choose_chunks(chosen, pg.size(), _Shape(shape), concrete_name(transport, pg.group_name, device))


def _heuristic(chunks, chosen, shape, pg, device, transport) -> Choice:
    stats["heuristic"] += 1
    m, c = heuristic_candidate(chunks, chosen, shape, pg, device, transport)
    return Choice(m, c, "heuristic", {})


class _Shape:
    """A stand-in with ``.shape`` for :func:`choose_chunks` (which reads only the shape)."""

    def __init__(self, shape):
        self.shape = torch.Size(shape)


def _choose(mode, chunks, chosen, shape, dtype, device, pg, transport, runner=None) -> Choice | None:
    from ..group import backend_name

    w = pg.size()
    fake = backend_name(pg) == "fake"
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    cands = candidates(mode, chunks, shape[2], w) if w > 1 else []
    if not config.settings.tune_modes or fake or capturing or w == 1:
        if capturing:
            return None  # the heuristic, not kept: measured by the first call outside capture
        choice = _heuristic(chunks, chosen, shape, pg, device, transport)
    elif len(cands) == 1:
        choice = Choice(cands[0][0], cands[0][1], "single", {})
    else:
        preferred = heuristic_candidate(chunks, chosen, shape, pg, device, transport)
        choice = _agreed_or_measured(cands, chosen, preferred, shape, dtype, device, pg, transport, runner)
    return choice


# ---- agreement, measuring ------------------------------------------------------------------------
def _agreed_or_measured(cands, default_mode, preferred, shape, dtype, device, pg, transport, runner=None) -> Choice:
    from ..contract import check_settings_agree

    # first, one rank-contract exchange: a peer with measuring off makes its op call's exchange meanwhile, the
    # signatures differ (the settings), and both raise ValueError naming tune_modes (never a mismatched collective)
    check_settings_agree(pg)
    dkey = disk_key(shape, dtype, device, pg.size(), transport, cands, preferred)
    entry = _read_cache().get(dkey)
    code = 0
    if entry is not None and [entry.get("mode"), entry.get("chunks")] in [list(c) for c in cands]:
        code = [list(c) for c in cands].index([entry["mode"], entry["chunks"]]) + 1
    t = torch.tensor([code, -code], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    hi, lo = t[0].item(), -t[1].item()
    if hi == lo and hi > 0:  # every rank holds the same cached candidate
        stats["disk"] += 1
        m, c = cands[int(hi) - 1]
        return Choice(m, c, "disk", dict(entry.get("times_ms", {})))
    times = measure(cands, shape, dtype, device, pg, transport, runner)
    best = pick(cands, times, default_mode, preferred=preferred)
    stats["measured"] += 1
    named = {f"{m}/{c}": t for (m, c), t in zip(cands, times)}
    choice = Choice(cands[best][0], cands[best][1], "measured", named)
    _write_cache(dkey, {"mode": choice.mode, "chunks": choice.chunks, "times_ms": named, "margin": MARGIN,
                        "measured_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    return choice


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
    stats["timed"] += len(cands)
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


# ---- the disk cache ------------------------------------------------------------------------------
def cache_path() -> str | None:
    """The disk cache's file (None: ``tune_cache`` is 'off')."""
    p = config.settings.tune_cache
    if p is not None and p.strip().lower() == "off":
        return None
    if p:
        return os.path.expanduser(p)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cp_ops", "choices.json")


def machine(device: torch.device) -> dict:
    """What a measured time depends on besides the call: device model, driver, torch and cp_ops versions."""
    from .._version import __version__

    if device.type == "cuda":
        dev, driver = torch.cuda.get_device_name(device), _driver_version()
    else:
        dev, driver = f"{device.type}:{platform.processor() or platform.machine()}:{_cores()} cores", "-"
    return {"device": dev, "driver": driver, "torch": torch.__version__, "cp_ops": __version__}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            for word in f.readline().split():
                if word[:1].isdigit() and "." in word:
                    return word
    except OSError:
        pass
    try:
        import ctypes

        v = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        return f"cuda-driver-api-{v.value}"
    except (OSError, AttributeError):
        return "unknown"


def disk_key(shape, dtype, device, world_size, transport, cands, preferred=None) -> str:
    """The disk cache's key of a decision (one line of JSON: machine, versions, call, candidates, :data:`MARGIN`,
    the heuristic's candidate :func:`pick` prefers within the margin, so a change of the heuristic's table
    measures again)."""
    b, s, h, d = shape
    return json.dumps(dict(machine(device), W=world_size, B=b, S_local=s, H=h, D=d,
                           dtype=str(dtype).replace("torch.", ""), transport=transport, margin=MARGIN,
                           candidates=[f"{m}/{c}" for m, c in cands],
                           preferred=None if preferred is None else f"{preferred[0]}/{preferred[1]}"), sort_keys=True)


def _valid_entry(e) -> bool:
    """A cache entry as :func:`_write_cache` writes it: ``mode`` a str, ``chunks`` an int >= 1, ``times_ms`` (if
    present) a dict of str -> finite number. Anything else (hand-edited, another tool's, mangled) is ignored."""
    if not isinstance(e, dict) or not isinstance(e.get("mode"), str):
        return False
    c = e.get("chunks")
    if not isinstance(c, int) or isinstance(c, bool) or c < 1:
        return False
    times = e.get("times_ms", {})
    return isinstance(times, dict) and all(
        isinstance(k, str) and isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
        for k, t in times.items()
    )


def _read_cache() -> dict:
    """The cache file's well-formed entries ({} when off, missing or unreadable; a warning names a file that does
    not parse or holds malformed entries). Never raises on the file's content: a rank holding a mangled file
    alone must not fail while its peers wait for it in the agreement's all-reduce."""
    path = cache_path()
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError, MemoryError) as e:  # RecursionError: nesting too deep to parse
        _warn_once(path, f"cp_ops: ignoring the choice cache {path}, which does not parse ({type(e).__name__}: "
                         f"{str(e)[:200]}); it is rewritten after the next measurement")
        return {}
    entries = data.get("entries") if isinstance(data, dict) and data.get("format") == FORMAT else None
    if not isinstance(entries, dict):
        return {}  # another format (or none): measured again and rewritten in this one
    good = {k: e for k, e in entries.items() if _valid_entry(e)}
    if len(good) < len(entries):
        _warn_once(path, f"cp_ops: ignoring {len(entries) - len(good)} malformed entries of the choice cache {path} "
                         "(wrong types); they are dropped at the next write")
    return good


def _write_cache(key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` (read-modify-write under an exclusive lock; atomic replace)."""
    path = cache_path()
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".lock", "a") as lock:
            try:
                import fcntl

                fcntl.flock(lock, fcntl.LOCK_EX)
            except ImportError:  # not POSIX: last writer wins
                pass
            entries = _read_cache()
            entries[key] = entry
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump({"format": FORMAT, "entries": entries}, f, indent=1)
            os.replace(tmp, path)
    except OSError as e:
        _warn_once(path, f"cp_ops: cannot write the choice cache {path} ({e}); set CP_OPS_TUNE_CACHE to a writable "
                         "file, or to off")


def _warn_once(path: str, message: str) -> None:
    """Warn ``message`` (about the cache file ``path``) once per process."""
    if (path, message) not in _warned:
        _warned.add((path, message))
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def clear_memory() -> None:
    """Forget the in-process choices (the next call of each request agrees or measures again), and the eager
    plans that hold them (callbacks added with :func:`on_clear`: :mod:`cp_ops.dispatch` adds its ``forget``); tests
    use it."""
    _memo.clear()
    _choices.clear()
    for fn in _ON_CLEAR:
        fn()


_ON_CLEAR: list = []


def on_clear(fn) -> None:
    """Call ``fn()`` whenever :func:`clear_memory` runs (a cache above this module that holds its choices)."""
    if fn not in _ON_CLEAR:
        _ON_CLEAR.append(fn)
