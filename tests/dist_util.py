"""Run a test body on W real gloo ranks (separate processes) and re-raise the first rank's failure.

Every call gets W fresh processes with their own process group, as a spawn per call did, but on CPU they are
forked from one fork server (``multiprocessing``'s ``forkserver``, started at the first call of a pytest session,
ended at its end) that has already imported torch, Dynamo/Inductor, pytest, cp_ops and diffusers' models
(tests/rank_preload.py): a rank costs a ``fork`` instead of an interpreter start and those imports (~2-5 s for
``import torch`` alone, a process on CI's 2 cores). Nothing a test does in its ranks (monkeypatching, cp_ops'
per-group state, a killed or hung rank) can reach another test: the processes die with the call. CPU ranks run
``torch.set_num_threads(cores // W)`` (at least 1), as the CPU ranks of ``cp-ops bench``/``run``/``generate`` do:
W ranks with a thread per core each spun on each other's cores (on CI's 2 cores, -30% CPU time measured).

Each rank takes the calling test's environment: ``CP_OPS_*`` set or removed by the test reach it, and
``cp_ops.config.settings`` is re-read from them, as ``import cp_ops`` would have. What the server cannot give a rank
exactly as a fresh interpreter would, it does not: ``device='cuda'``, any rank on a CUDA machine (CUDA is unusable
in the server's forks), ``fresh=True`` (a test about import-time behaviour), an environment that differs from the
server's in a variable that may be read at import (:data:`IMPORT_TIME`: say ``TORCH_LOGS``,
``TORCHINDUCTOR_FX_GRAPH_CACHE``, ``OMP_NUM_THREADS``), and ``CP_OPS_TESTS_SPAWN=1`` (every call) spawn fresh
interpreters as before. The session's summary says how many calls did which, and why.
"""

from __future__ import annotations

import atexit
import collections
import multiprocessing.forkserver
import os
import traceback

import torch
import torch.multiprocessing as mp

import one_gpu_rank
from cp_ops.cli.launch import free_port, run_rank

_HERE = os.path.dirname(os.path.abspath(__file__))
#: what the fork server imports once (tests/rank_preload.py lists the modules)
PRELOAD = ["rank_preload"]
#: variables (by prefix) that torch, its compiler, OpenMP/MKL, diffusers or Python may read at import: a call whose
#: environment differs from the fork server's in one of them spawns fresh ranks (the server's imports did not see
#: it); any other difference (CP_OPS_*, which the rank re-reads, NCCL_*, what Inductor writes into the test
#: process's environment as it runs) is applied in the rank before its body runs
IMPORT_TIME = ("TORCH", "PYTORCH", "TRITON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "CUDA_", "HF_",
               "DIFFUSERS_", "TRANSFORMERS_", "PYTHON", "LD_")
#: read where used, not at import (Inductor sets TORCHINDUCTOR_CACHE_DIR in the test process at its first compile)
_READ_WHERE_USED = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")

#: how many calls forked from the server, how many spawned and why (printed at the end of a pytest session)
STATS: collections.Counter = collections.Counter()
_server_env: dict | None = None  # the environment the fork server started with (None: not started)


def _body(rank, world_size, device, fn, args, errq):
    try:
        if device.type == "cpu":  # the ranks share the cores, as cp-ops bench/run/generate's CPU ranks do
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
        fn(rank, world_size, *args)
        errq.put((rank, None))
    except BaseException as e:  # noqa: BLE001 - report any failure to the parent
        errq.put((rank, traceback.format_exc()))
        e._cp_ops_reported = True
        raise


def _forked(rank, world_size, device, port, env, removed, body_args):
    """A forked rank: take the caller's environment (``env``; ``removed``: variables the server started with that the
    caller no longer has; what the server's imports set stays, as a fresh rank's imports would set it), re-read
    cp_ops' settings from it, then run as a spawned rank would (``cp_ops.cli.launch.run_rank``). A failure before
    the body starts is reported too."""
    errq = body_args[-1]
    try:
        for k in removed:
            os.environ.pop(k, None)
        os.environ.update(env)
        _restore("PYTHONPATH", env)  # the server's has this folder prepended (_forkserver_context)
        from cp_ops import config

        config.restore(config.from_env())
        run_rank(rank, world_size, device, port, _body, body_args)
    except BaseException as e:  # noqa: BLE001
        if not getattr(e, "_cp_ops_reported", False):
            errq.put((rank, "(before or after the test body)\n" + traceback.format_exc()))
        raise


def _import_env_differs(env: dict) -> list[str]:
    """Variables that may be read at import (:data:`IMPORT_TIME`) whose value differs from the fork server's."""
    keys = set(env) | set(_server_env or {})
    return sorted(k for k in keys if k.startswith(IMPORT_TIME) and k not in _READ_WHERE_USED
                  and env.get(k) != _server_env.get(k))


def start_method(device: str, fresh: bool, env: dict) -> str:
    """``'forkserver'`` (fork from the session's server) or ``'spawn: <why>'`` (fresh interpreters) for a call;
    starts the server if it is to be used and not running (its environment is compared with ``env``)."""
    if fresh or device != "cpu" or env.get("CP_OPS_TESTS_SPAWN", "0") == "1":
        why = "fresh=True" if fresh else f"device={device}" if device != "cpu" else "CP_OPS_TESTS_SPAWN=1"
        return "spawn: " + why
    if torch.cuda.is_available():
        # The server's imports ask for the CUDA device count, after which CUDA is unusable in its forks, and Dynamo
        # touches CUDA (its RNG state) in every compile while CUDA is available: every CPU-rank compile raised
        # "Cannot re-initialize CUDA in forked subprocess" on the H200; reporting CUDA unavailable in the forks then
        # hung the same test there. On a CUDA machine CPU ranks are fresh interpreters.
        return "spawn: a CUDA machine (CUDA is unusable in a fork of the server)"
    _forkserver_context()
    differs = _import_env_differs(env)
    if differs:
        return "spawn: environment differs from the fork server's: " + ", ".join(differs)
    return "forkserver"


def _forkserver_context():
    """The fork server's context, started on first use with :data:`PRELOAD` and the current environment."""
    global _server_env
    ctx = mp.get_context("forkserver")
    if _server_env is None:
        ctx.set_forkserver_preload(PRELOAD)
        _server_env = dict(os.environ)
        # The server must find tests/rank_preload.py: Python <= 3.11's forkserver ignores the sys.path it is handed
        # (its preload then fails with an ImportError it swallows, and every rank imports torch, cp_ops, ...
        # itself), so the server starts with this folder on PYTHONPATH. The ranks get the caller's PYTHONPATH back
        # (_forked).
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_HERE, _server_env.get("PYTHONPATH")) if p)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            _restore("PYTHONPATH", _server_env)
    return ctx


def _restore(key: str, env: dict) -> None:
    """os.environ[key] as in ``env`` (removed if ``env`` lacks it)."""
    if key in env:
        os.environ[key] = env[key]
    else:
        os.environ.pop(key, None)


def stop_server() -> None:
    """End the fork server (pytest session end; also at interpreter exit). The next call starts a new one."""
    global _server_env
    if _server_env is not None:
        stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)  # private; Python 3.8-3.13 have it
        if stop is not None:
            stop()
        _server_env = None


atexit.register(stop_server)


#: what gloo raises in ``init_process_group`` when the rendezvous's port met another process's socket (``free_port``
#: picks a port, closes it, and rank 0 binds it a moment later: a test running beside this one can take it between)
_RENDEZVOUS_RACE = "Gloo connectFullMesh failed"


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, device: str = "cpu", fresh: bool = False,
              backend: str | None = None) -> None:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo on CPU, NCCL with one GPU
    each on ``device='cuda'``, every rank on cuda:0 over gloo on ``device='one_gpu'``); raise if any rank fails, hangs past ``timeout`` seconds or exits non-zero.
    ``backend='staged'`` (``device='one_gpu'`` or ``'cpu'``; spawned ranks): the default group is tests/staged_pg.py's,
    every collective staged through host memory onto gloo (gloo's own CUDA path crashed in other libraries' calls).

    ``fn`` must be importable (a module-level function of a test module). ``fresh=True``: spawn new interpreters
    (for a test about what a rank imports); otherwise CPU ranks are forked from the session's fork server (see the
    module docstring for when it spawns anyway). A group whose gloo rendezvous failed on every failing rank before
    ``fn`` ran (:data:`_RENDEZVOUS_RACE`: the port taken by a test beside it) is started once more on a new port.
    """
    os.environ.setdefault("CP_OPS_TIMEOUT_S", "60")
    if backend not in (None, "staged") or (backend and device not in ("one_gpu", "cpu")):
        raise ValueError(f"run_ranks: backend='staged' runs on device 'one_gpu' or 'cpu'; "
                         f"got backend={backend!r} on {device!r}")
    for attempt in (1, 2):
        errors, hung, bad = _attempt(fn, world_size, args, timeout, device, fresh, backend)
        if attempt == 1 and errors and not hung and all(_RENDEZVOUS_RACE in e and "init_rank" in e for e in errors):
            STATS["started again: the gloo rendezvous failed before the body (" + _RENDEZVOUS_RACE + ")"] += 1
            continue
        break
    if errors:
        raise AssertionError("\n".join(errors))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s")
    if bad:
        raise AssertionError(f"ranks exited non-zero: {bad}")


def _attempt(fn, world_size, args, timeout, device, fresh, backend=None):
    """One start of the group: (the ranks' error reports, the ranks that hung, (rank, exit code) of those that exited
    non-zero)."""
    env = dict(os.environ)
    how = f"spawn: backend={backend}" if backend else start_method(device, fresh, env)
    STATS["forked from the fork server" if how == "forkserver" else how] += 1
    forked = how == "forkserver"
    ctx = _forkserver_context() if forked else mp.get_context("spawn")
    errq = ctx.Queue()
    port = free_port()
    if forked:
        removed = [k for k in _server_env if k not in env]
        procs = [ctx.Process(target=_forked, args=(r, world_size, device, port, env, removed, (fn, args, errq)))
                 for r in range(world_size)]
    else:
        if device == "one_gpu" or backend:  # the body named, not pickled: the rank imports it after joining the group
            ref = f"{fn.__module__}:{fn.__qualname__}"
            procs = [ctx.Process(target=one_gpu_rank.worker,
                                 args=(r, world_size, port, ref, args, errq, backend, device == "one_gpu"))
                     for r in range(world_size)]
        else:
            procs = [ctx.Process(target=run_rank, args=(r, world_size, device, port, _body, (fn, args, errq)))
                     for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    errors = []
    while not errq.empty():
        rank, err = errq.get()
        if err:
            errors.append(f"--- rank {rank} ---\n{err}")
    errq.close()
    errq.join_thread()
    return errors, hung, [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]

