"""The opt-in measured choice of ``mode='auto'`` / ``chunks=None``, beside the rules (:mod:`cp_ops.plan.rules`): the
candidates, the timing with the caller's runner, the pick, and what was chosen (memory, the cache file, the ranks'
agreement on it). For users: ``docs/measuring.md``, ``docs/settings.md`` (``CP_OPS_TUNE_MODES``, ``CP_OPS_TUNE_CACHE``).

Why a margin and the heuristic first: a pick by the bare minimum chose AGKV chunks=2 at 0.615 ms over chunks=1 at
0.469 ms in the bench (``benchmarks/results/cp2_attention/``). A cached candidate is used only when every rank holds it.
"""

from __future__ import annotations

import ctypes
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

from .. import config, contract
from .._file_lock import file_lock
from .._version import __version__
from ..group import backend_name
from ..modes import names as mode_names
from ..modes import spec as mode_spec
from ..modes.agkv_pipelined import stage_plan
from ..timing import available_cores, max_over_ranks_each, steady_ms
from ..transport.base import concrete_name
from ..validate import dtype_name
from .rules import chunks_rule

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
#: Time budget of the timed rounds of one decision, ms (estimated from one timed call per candidate).
BUDGET_MS = 500.0
#: A more complex candidate must be faster than a simpler one by more than this fraction to be chosen over it.
MARGIN = 0.03

class Choice(NamedTuple):
    """A decision for one request (``source``: 'explicit', 'heuristic', 'single', 'measured', 'cached', 'pending' or
    'cost'); the fields: :func:`cp_ops.describe`, which alone fills ``transport``."""

    mode: str
    chunks: int
    source: str
    times_ms: dict
    transport: str = ""
    why: str = ""


class Open(NamedTuple):
    """A request that measuring decides: its candidates (:func:`candidates`, in measuring order) and the heuristic's
    candidate (which :func:`pick` prefers within the margin)."""

    candidates: list
    preferred: tuple


#: ``runner(mode, chunks) -> run``: ``run()`` makes one call of the candidate (a collective) on the call's shapes.
Runner = Callable[[str, int], Callable[[], object]]


def choose(mode: str, chunks: int | None, chosen: str, shape, pg: dist.ProcessGroup, device, transport: str,
           measuring: bool, mode_why: str = "") -> Choice | Open:
    """The decision for a request on W ranks short of timing: a :class:`Choice` (explicit, the heuristic where
    measuring is off or cannot run, or the only candidate left), else an :class:`Open` request. ``chosen``,
    ``mode_why``: :func:`cp_ops.plan.rules.mode_rule`'s; ``transport`` 'auto' is resolved for the group (collective
    the first time: RuntimeError past ``CP_OPS_TIMEOUT_S``); ``measuring``: ``settings.tune_modes``."""
    if mode != "auto" and chunks is not None:
        return Choice(chosen, chunks, "explicit", {}, why="mode and chunks given by the caller")
    w = pg.size()
    why = ("traced by torch.compile: measuring is eager only" if torch.compiler.is_compiling()
           else "a group of one rank" if w == 1
           else "a 'fake' process group (nothing runs)" if backend_name(pg) == "fake"
           else "inside CUDA-graph capture" if torch.device(device).type == "cuda"
           and torch.cuda.is_current_stream_capturing()
           else "measuring off (CP_OPS_TUNE_MODES=0, the default)" if not measuring else None)
    if why is not None:
        return heuristic(chunks, chosen, pg, device, transport, why, mode_why)
    cands = candidates(mode, chunks, shape[2], w)
    if len(cands) == 1:
        return Choice(cands[0][0], cands[0][1], "single", {}, why="the only candidate the request leaves open")
    return Open(cands, (chosen, _chunks(chunks, chosen, pg, device, transport)[0]))


def measured(request: Open, chosen: str, shape, dtype, device, pg: dist.ProcessGroup, transport: str,
             runner: Runner | None) -> Choice:
    """Time ``request``'s candidates with ``runner`` (:func:`measure`) and :func:`pick` one (source 'measured').
    Collective. Raises ValueError without a runner, RuntimeError where a rank did not take part in time."""
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


def _chunks(chunks, chosen, pg, device, transport) -> tuple[int, str]:
    """The heuristic's chunks and reason: as given, or :func:`cp_ops.plan.rules.chunks_rule` on the transport the call
    runs on ('auto' resolved for the group by :func:`cp_ops.transport.base.concrete_name`)."""
    if chunks is not None:
        return chunks_rule(chosen, pg.size(), transport, chunks)
    return chunks_rule(chosen, pg.size(), concrete_name(transport, pg.group_name, device))


def heuristic(chunks, chosen, pg, device, transport, reason: str, mode_why: str = "") -> Choice:
    """The heuristic's candidate as a :class:`Choice`, ``why`` naming ``reason`` (nothing measured) and the rules'."""
    c, chunks_why = _chunks(chunks, chosen, pg, device, transport)
    return Choice(chosen, c, "heuristic", {},
                  why=f"the heuristic: {reason}" + (f"; {mode_why}" if mode_why else "") + f"; {chunks_why}")


def pick(cands: list[tuple[str, int]], times: list[float], default_mode: str, margin: float | None = None,
         preferred: tuple[str, int] | None = None) -> int:
    """The index of the chosen candidate among those within ``margin`` (default :data:`MARGIN`) of the fastest
    (``min(times) >= times[i] * (1 - margin)``): ``preferred`` (the heuristic's) where it is one, else the simplest:
    fewer chunks, then ``default_mode`` first, then the earlier in ``cands``. Pure: equal ``times``, equal pick."""
    m = MARGIN if margin is None else margin
    fastest = min(times)
    ok = [i for i, t in enumerate(times) if fastest >= t * (1.0 - m)]
    if preferred is not None:
        for i in ok:
            if tuple(cands[i]) == tuple(preferred):
                return i
    return min(ok, key=lambda i: (cands[i][1], cands[i][0] != default_mode, i))


def measure(cands, shape, dtype, device, pg, transport, runner: Runner | None = None) -> list[float]:
    """Each candidate's ms per call: the median of its interleaved samples (:func:`schedule`), max over the ranks
    of ``pg``. Collective: every rank makes the same ``runner(mode, chunks)()`` calls (ValueError without one)."""
    if runner is None:
        raise ValueError("tune.measure needs a runner(mode, chunks) from its caller (cp_ops.plan.flat.runner)")
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
    """``(calls per sample of each candidate, rounds)`` from the estimated ms per call (max over ranks): calls =
    ceil(:data:`SAMPLE_MS` / est), rounds = what fits in :data:`BUDGET_MS`, each clamped to its bounds."""
    calls = [max(1, min(MAX_CALLS, math.ceil(SAMPLE_MS / max(e, 1e-3)))) for e in est_ms]
    per_round = sum(n * max(e, 1e-3) for n, e in zip(calls, est_ms))
    rounds = max(MIN_ROUNDS, min(ROUNDS, int(BUDGET_MS // per_round)))
    return calls, rounds


def _timer(cand: tuple[str, int], run: Callable[[], object], device: torch.device, calls: int) -> float:
    """One sample of candidate ``cand`` on this rank: ``calls`` runs of ``run()`` back to back, ms per call
    (:func:`cp_ops.timing.steady_ms`); tests replace it."""
    del cand
    return steady_ms(run, device, 0, 1, calls)[0]


#: Format of the cache file; a file of another format is ignored (and replaced on the next write).
FORMAT = 3

#: Counters for tests and reports: decisions 'measured', 'cached' (from the file) and 'heuristic'; candidates 'timed'.
stats = {"measured": 0, "timed": 0, "cached": 0, "heuristic": 0}
#: (group, mode, chunks, shape, dtype, device, transport, tune_modes, comm) -> Choice, keyed by the group object (a
#: destroyed group's entries dropped: :func:`drop_destroyed`); at most :data:`MAX_MEMO`, the oldest dropped first.
_memo: dict[tuple, Choice] = {}
#: The most requests :data:`_memo` keeps (a model makes a handful; a sweep over shapes or groups would grow it).
MAX_MEMO = 1024
_warned: set[tuple[str, str]] = set()


def decide(mode: str, chunks: int | None, chosen: str, q: torch.Tensor, group: dist.ProcessGroup, transport: str,
           runner: Runner | None = None, comm: str = "", mode_why: str = "") -> Choice:
    """``(mode, chunks)`` for a call on W > 1 ranks, the same on every rank: the choice stored for the request, else
    :func:`choose`'s, measured where it leaves the request open. Arguments as :func:`choose`'s (``q``: only its
    shape, dtype and device are read), ``runner``: what :func:`measure` times, ``comm``: the FP8 formats' tag
    (:func:`cp_ops.comm_dtype.tag`), part of the request. First use only: ValueError on every rank where the ranks'
    collective settings differ, or measuring runs without a runner; RuntimeError where a rank did not take part."""
    shape = tuple(q.shape)
    if mode != "auto" and chunks is not None or torch.compiler.is_compiling():  # explicit, or the heuristic: not stored
        return choose(mode, chunks, chosen, shape, group, q.device, transport, False, mode_why)
    key = (group, mode, chunks, q.shape, q.dtype, q.device, transport, config.settings.tune_modes, comm)
    hit = _memo.get(key)
    if hit is not None:  # the stored choice: one dict lookup
        return hit
    c = choose(mode, chunks, chosen, shape, group, q.device, transport, config.settings.tune_modes, mode_why)
    if isinstance(c, Open):
        c = _agreed_or_measured(c, chosen, shape, q.dtype, q.device, group, transport, runner, comm)
    elif q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return c  # not kept: measured (where asked for) by the first call outside capture
    elif c.source == "heuristic":
        stats["heuristic"] += 1
    if len(_memo) >= MAX_MEMO:
        del _memo[next(iter(_memo))]  # the oldest request
    _memo[key] = c
    return c


def lookup(mode: str, chunks: int | None, q: torch.Tensor, group: dist.ProcessGroup, transport: str,
           comm: str = "") -> Choice | None:
    """The :class:`Choice` :func:`decide` stored for this request on ``group``, or None (not yet, or not stored:
    explicit, traced, captured). Local: no collective."""
    return _memo.get((group, mode, chunks, q.shape, q.dtype, q.device, transport, config.settings.tune_modes, comm))


def drop_destroyed() -> None:
    """Drop the stored choices of every destroyed group (:mod:`cp_ops.plan` calls it when cp_ops notices one)."""
    contract.drop_destroyed(_memo, 0)


# ---- agreement on the file, else measuring ------------------------------------------------------------------------
def _agreed_or_measured(request: Open, chosen, shape, dtype, device, pg, transport, runner, comm="") -> Choice:
    # first, one rank-contract exchange: a peer with measuring off makes its op call's exchange meanwhile, the
    # signatures differ (the settings), and both raise ValueError naming tune_modes (never a mismatched collective)
    contract.check_settings_agree(pg)
    cands = [list(c) for c in request.candidates]
    dkey = disk_key(shape, dtype, device, pg.size(), transport, request.candidates, request.preferred, comm)
    entry = _read_cache().get(dkey)
    code = 0
    if entry is not None and [entry.get("mode"), entry.get("chunks")] in cands:
        code = cands.index([entry["mode"], entry["chunks"]]) + 1
    hi, neg_lo = max_over_ranks_each([code, -code], device, pg)  # the highest and the lowest code over the ranks
    if hi == -neg_lo and hi > 0:  # every rank holds the same cached candidate
        stats["cached"] += 1
        m, c = request.candidates[int(hi) - 1]
        return Choice(m, c, "cached", dict(entry.get("times_ms", {})),
                      why=f"measured earlier, read from the cache file {cache_path()} (every rank holds it)")
    choice = measured(request, chosen, shape, dtype, device, pg, transport, runner)
    stats["measured"] += 1
    stats["timed"] += len(request.candidates)
    _write_cache(dkey, {"mode": choice.mode, "chunks": choice.chunks, "times_ms": choice.times_ms,
                        "margin": MARGIN,
                        "measured_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    return choice


# ---- the file -----------------------------------------------------------------------------------------------------
def cache_path() -> str | None:
    """The cache file (None: ``tune_cache`` is 'off')."""
    p = config.settings.tune_cache
    if p is not None and p.strip().lower() == "off":
        return None
    if p:
        return os.path.expanduser(p)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cp_ops", "choices.json")


def machine(device: torch.device) -> dict:
    """What a measured time depends on besides the call: device model, driver, torch and cp_ops versions."""
    if device.type == "cuda":
        dev, driver = torch.cuda.get_device_name(device), _driver_version()
    else:
        dev, driver = f"{device.type}:{platform.processor() or platform.machine()}:{available_cores()} cores", "-"
    return {"device": dev, "driver": driver, "torch": torch.__version__, "cp_ops": __version__}


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            for word in f.readline().split():
                if word[:1].isdigit() and "." in word:
                    return word
    except OSError:
        pass
    try:
        v = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v))
        return f"cuda-driver-api-{v.value}"
    except (OSError, AttributeError):
        return "unknown"


def disk_key(shape, dtype, device, world_size, transport, cands, preferred=None, comm: str = "") -> str:
    """The file's key of a decision (one line of JSON: machine, versions, call, candidates, margin, the heuristic's
    candidate, so a change of the heuristic measures again; ``comm`` only where given: other keys are unchanged)."""
    b, s, h, d = shape
    extra = {"comm": comm} if comm else {}
    return json.dumps(dict(machine(device), W=world_size, B=b, S_local=s, H=h, D=d,
                           dtype=dtype_name(dtype), transport=transport, margin=MARGIN,
                           candidates=[f"{m}/{c}" for m, c in cands],
                           preferred=None if preferred is None else f"{preferred[0]}/{preferred[1]}", **extra),
                      sort_keys=True)


def _valid_entry(e) -> bool:
    """As :func:`_write_cache` writes it: ``mode`` a str, ``chunks`` an int >= 1, any ``times_ms`` str -> finite."""
    if not isinstance(e, dict) or not isinstance(e.get("mode"), str):
        return False
    c = e.get("chunks")
    if not isinstance(c, int) or isinstance(c, bool) or c < 1:
        return False
    times = e.get("times_ms", {})
    return isinstance(times, dict) and all(
        isinstance(k, str) and isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
        for k, t in times.items())


def _read_cache() -> dict:
    """The cache file's well-formed entries ({} when off, missing or unreadable; a warning names a bad file). Never
    raises on the content: a rank with a mangled file must not fail while its peers wait in the agreement."""
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
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}  # another format (or none): measured again and rewritten in this one
    entries = data.get("entries")
    if not isinstance(entries, dict):
        _warn_once(path, f"cp_ops: ignoring the choice cache {path}: its 'entries' is a {type(entries).__name__}, "
                         "not a mapping; it is rewritten after the next measurement")
        return {}
    good = {k: e for k, e in entries.items() if _valid_entry(e)}
    if len(good) < len(entries):
        _warn_once(path, f"cp_ops: ignoring {len(entries) - len(good)} malformed entries of the choice cache {path} "
                         "(wrong types); they are dropped at the next write")
    return good


def _write_cache(key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` (read-modify-write under an exclusive lock, :func:`cp_ops._file_lock.file_lock`: a
    wait bounded by ``settings.timeout_s``; atomic replace)."""
    path = cache_path()
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with file_lock(path + ".lock", config.settings.timeout_s, f"the choice cache {path}"):
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
