"""The stored choices of ``mode='auto'`` / ``chunks=None`` (issue 19 item 3): what :mod:`cp_ops.dispatch` decided for
each request, in memory and — when measuring is on — in a file, with the ranks' agreement on what the file holds.

The decision itself is :mod:`cp_ops.modes.tune` (candidates, the heuristic, the pick, the timing with the caller's
runner); this module keeps its results. :func:`decide` is what the dispatcher calls:

* an explicit mode and chunk count: returned as given (nothing stored);
* code traced by ``torch.compile``, or a first call inside CUDA-graph capture: the heuristic, not stored (a capture's
  request is decided again — measured where asked for — by its first call outside capture);
* else the choice stored in memory for the request — (CP group, request, ``q``'s shape, dtype, device, transport,
  the measuring setting) — a dict lookup (about 1 µs); on a miss :func:`cp_ops.modes.tune.choose`, and where it
  leaves the request open (measuring on, several candidates) the file below, then measuring.

Measuring off (``CP_OPS_TUNE_MODES=0``, the default): the heuristic, kept in memory only; no file is read or
written. The same inputs give the same variant in every process.

The file (measuring on only): the measured choices, with their times, in the JSON file ``settings.tune_cache``
(``CP_OPS_TUNE_CACHE``; default ``$XDG_CACHE_HOME/cp_ops/choices.json``, ``~/.cache/...`` without it; ``off``: no
file), keyed by the machine (GPU model and driver version, or the CPU), the torch and cp_ops versions, the call, the
margin and the heuristic's candidate (:func:`disk_key`), so a later process with the same file makes the same choice
without timing (deterministic once cached). Format :data:`FORMAT` = 3 since the pick prefers the heuristic's
candidate within the margin (format 2: the simplest; format 1: the bare minimum of 3 samples): a file of another
format is ignored, its requests measured again and the file rewritten in format 3.

Agreement (collective, first use of a request per process): a rank cannot trust its own file alone (a rank with a
stale or missing file would skip measuring while its peers measure, and the collectives would mismatch). Before its
first collective a measuring rank compares the collective settings over the group
(:func:`cp_ops.contract.check_settings_agree`; ``tune_modes`` is one of :data:`cp_ops.config.COLLECTIVE_FIELDS`): a
peer with measuring off meets that exchange with its op's own, and both raise ValueError naming the setting instead
of hanging. Then the ranks exchange which cached candidate each holds (one all-reduce over the group) and use it only
when every rank holds the same one (source 'cached'); otherwise all measure and every rank rewrites its entry. A file
that does not parse (bad JSON, nesting too deep for the parser: ``RecursionError``) or whose entries have wrong types
(:func:`_valid_entry`) is ignored, in whole or those entries, with a warning naming the file, on the rank holding it:
that rank then holds no cached candidate, so every rank measures alike (no rank raises while its peers wait). An
unwritable file is reported once (a warning); neither stops the call.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import warnings

import torch
import torch.distributed as dist

from . import config, contract
from .modes import tune
from .modes.tune import Choice
from .validate import dtype_name

#: Format of the cache file; a file of another format is ignored (and replaced on the next write).
FORMAT = 3

#: Counters for tests and reports: 'measured' (decisions measured), 'timed' (candidates timed), 'cached' (decisions
#: taken from the file every rank holds alike), 'heuristic' (decisions the heuristic made and kept).
stats = {"measured": 0, "timed": 0, "cached": 0, "heuristic": 0}
#: (group, mode, chunks, shape, dtype, device, transport, tune_modes, comm) -> Choice. Keyed by the group object (as
#: :mod:`cp_ops.transport.base`'s per-group choices: torch reuses a destroyed group's name), a destroyed group's
#: entries dropped when cp_ops notices it (:func:`cp_ops.contract.on_group_destroyed`); at most :data:`MAX_MEMO`
#: entries, the oldest dropped first (decided again at its next call: the heuristic, or the file every rank holds).
_memo: dict[tuple, Choice] = {}
#: The most requests :data:`_memo` keeps (a model makes a handful; a sweep over shapes or groups would grow it).
MAX_MEMO = 1024
_warned: set[tuple[str, str]] = set()
_ON_FORGET: list = []


def decide(mode: str, chunks: int | None, chosen: str, q: torch.Tensor, group: dist.ProcessGroup, transport: str,
           runner: tune.Runner | None = None, comm: str = "") -> tuple[str, int]:
    """``(mode, chunks)`` for a call of :func:`cp_ops.attention` on W > 1 ranks, the same on every rank (see the
    module docstring).

    Args:
        mode, chunks: as the caller passed them (``'auto'`` / ``None`` = open). chosen: ``cp_ops.modes.choose(mode,
            H, W)`` (checked). q: this rank's ``[B, S_local, H, D]`` (only shape, dtype, device are read). group: the
            CP group. transport: the resolved transport ('torch', 'fast', 'auto').
        runner: what :func:`cp_ops.modes.tune.measure` times when measuring runs (:data:`cp_ops.modes.tune.Runner`:
            the dispatcher gives :func:`cp_ops.dispatch.runner`); required where measuring runs.
        comm: what crosses the link in another format than q's (:func:`cp_ops.comm_dtype.tag`; '' = nothing): part
            of the request, in memory and in the file (an FP8 call is timed, and its choice kept, apart).
    Returns:
        the mode name and the chunk count (≥ 1).
    Raises:
        ValueError: the ranks' collective settings differ (first use only; raised on every rank); measuring runs and
            no runner was given.
        RuntimeError: a rank did not take part within ``CP_OPS_TIMEOUT_S`` (first use only).
    """
    if mode != "auto" and chunks is not None:
        return chosen, chunks
    shape = tuple(q.shape)
    if torch.compiler.is_compiling():  # traced: the heuristic, nothing stored
        return tune.heuristic_candidate(chunks, chosen, shape, group, q.device, transport)
    key = (group, mode, chunks, q.shape, q.dtype, q.device, transport, config.settings.tune_modes, comm)
    hit = _memo.get(key)
    if hit is not None:  # the stored choice: one dict lookup
        return hit.mode, hit.chunks
    c = tune.choose(mode, chunks, chosen, shape, group, q.device, transport, config.settings.tune_modes)
    if isinstance(c, tune.Open):
        c = _agreed_or_measured(c, chosen, shape, q.dtype, q.device, group, transport, runner, comm)
    elif q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return c.mode, c.chunks  # not kept: measured (where asked for) by the first call outside capture
    elif c.source == "heuristic":
        stats["heuristic"] += 1
    if len(_memo) >= MAX_MEMO:
        del _memo[next(iter(_memo))]  # the oldest request
    _memo[key] = c
    return c.mode, c.chunks


def lookup(mode: str, chunks: int | None, q: torch.Tensor, group: dist.ProcessGroup, transport: str,
           comm: str = "") -> Choice | None:
    """The :class:`~cp_ops.modes.tune.Choice` :func:`decide` stored for this request on ``group`` (None before it
    made one, or for a request it does not store: explicit mode and chunks, traced, captured). ``transport``,
    ``comm``: as :func:`decide` got them. Local: no collective."""
    return _memo.get((group, mode, chunks, q.shape, q.dtype, q.device, transport, config.settings.tune_modes, comm))


def forget() -> None:
    """Forget the in-process choices (the next call of each request agrees or measures again), and what holds them
    above this module (callbacks added with :func:`on_forget`: :mod:`cp_ops.dispatch` adds its plans' ``forget``);
    tests use it. The file is left as it is."""
    _memo.clear()
    for fn in _ON_FORGET:
        fn()


def on_forget(fn) -> None:
    """Call ``fn()`` whenever :func:`forget` runs (a cache above this module that holds its choices)."""
    if fn not in _ON_FORGET:
        _ON_FORGET.append(fn)


def _drop_destroyed(_pg=None) -> None:
    """Drop the stored choices of every destroyed group (called when cp_ops notices one)."""
    contract.drop_destroyed(_memo, 0)


contract.on_group_destroyed(_drop_destroyed)


# ---- agreement on the file, else measuring ------------------------------------------------------------------------
def _agreed_or_measured(request: tune.Open, chosen, shape, dtype, device, pg, transport, runner, comm="") -> Choice:
    # first, one rank-contract exchange: a peer with measuring off makes its op call's exchange meanwhile, the
    # signatures differ (the settings), and both raise ValueError naming tune_modes (never a mismatched collective)
    contract.check_settings_agree(pg)
    cands = [list(c) for c in request.candidates]
    dkey = disk_key(shape, dtype, device, pg.size(), transport, request.candidates, request.preferred, comm)
    entry = _read_cache().get(dkey)
    code = 0
    if entry is not None and [entry.get("mode"), entry.get("chunks")] in cands:
        code = cands.index([entry["mode"], entry["chunks"]]) + 1
    t = torch.tensor([code, -code], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    hi, lo = t[0].item(), -t[1].item()
    if hi == lo and hi > 0:  # every rank holds the same cached candidate
        stats["cached"] += 1
        m, c = request.candidates[int(hi) - 1]
        return Choice(m, c, "cached", dict(entry.get("times_ms", {})),
                      why=f"measured earlier, read from the cache file {cache_path()} (every rank holds it)")
    choice = tune.measured(request, chosen, shape, dtype, device, pg, transport, runner)
    stats["measured"] += 1
    stats["timed"] += len(request.candidates)
    _write_cache(dkey, {"mode": choice.mode, "chunks": choice.chunks, "times_ms": choice.times_ms,
                        "margin": tune.MARGIN,
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
    from ._version import __version__

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


def disk_key(shape, dtype, device, world_size, transport, cands, preferred=None, comm: str = "") -> str:
    """The file's key of a decision (one line of JSON: machine, versions, call, candidates, the margin, the
    heuristic's candidate :func:`cp_ops.modes.tune.pick` prefers within the margin, so a change of the heuristic's
    table measures again; ``comm``, the FP8 formats on the link (:func:`decide`), only where there are some: the keys of
    calls without them are unchanged)."""
    b, s, h, d = shape
    extra = {"comm": comm} if comm else {}
    return json.dumps(dict(machine(device), W=world_size, B=b, S_local=s, H=h, D=d,
                           dtype=dtype_name(dtype), transport=transport, margin=tune.MARGIN,
                           candidates=[f"{m}/{c}" for m, c in cands],
                           preferred=None if preferred is None else f"{preferred[0]}/{preferred[1]}", **extra),
                      sort_keys=True)


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
