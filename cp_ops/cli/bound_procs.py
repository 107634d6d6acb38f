"""``cp-ops bound``'s child processes: ``--side-processes`` (each side of a compiled mode in its own process on the
parent's shared weights, asked for its forwards through a pipe; every wait bounded) and ``--compile-workers`` (each
side compiled first in a child, filling torch's on-disk compile caches)."""

from __future__ import annotations

import functools
import os
import time
from types import SimpleNamespace

import torch

from ..timing import time_ms
from . import bound_fill
from .bound_sides import Side, _reason, _timed, parse_mode


def _child_run(run, args_dict: dict, device: str, parent_pid: int | None, **changes) -> None:
    """A child's body: ``run`` (:func:`cp_ops.cli.bound.run_bound`) on the parent's arguments with ``changes`` (no
    workers, file or profile), stdout silenced; it dies with its parent."""
    import contextlib
    import io

    _die_with_parent(parent_pid)
    args = SimpleNamespace(**args_dict)
    vars(args).update(compile_workers=0, out=None, profile=None, **changes)
    with contextlib.redirect_stdout(io.StringIO()):
        run(args, torch.device(device))


def _compile_one(args_dict: dict, device: str, mode_text: str, side: str, results, run) -> None:
    """A :func:`precompile` child: build ``side`` of ``mode_text`` and run its first call (the compile); puts ``(mode,
    side, seconds, error or None)`` on ``results``."""
    t0 = time.perf_counter()
    err = None
    try:
        _child_run(run, args_dict, device, None, only_side=(mode_text, side))
    except Exception as e:  # noqa: BLE001 - reported; the parent's own build meets (and reports) it again
        err = _reason(e)
    results.put((mode_text, side, time.perf_counter() - t0, err))


def _die_with_parent(parent_pid: int | None = None) -> None:
    """SIGKILL this child when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere the parent's clean-up only), so
    no child keeps the device's memory; ``parent_pid``: a parent already gone ends the child here."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux / no glibc
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)

#: bounds on the waits for a side's process (s): its build, compile and first call; one timing request
BUILD_TIMEOUT_S = 3600.0

SAMPLE_TIMEOUT_S = 900.0

#: how long :func:`stop_sides` gives the sides' processes to end when asked, all together (s), before killing them
STOP_GRACE_S = 10.0


def _serve_side(args_dict: dict, device: str, mode_text: str, side: str, conn, base, parent_pid, run) -> None:
    """A ``--side-processes`` child: build ``side`` of ``mode_text`` on the parent's model ``base`` (weights shared),
    run its first call, then answer requests on ``conn`` (:func:`_serve`); an error is sent as ``('error', why)``."""
    try:
        _child_run(run, args_dict, device, parent_pid, side_processes=False, only_side=(mode_text, side),
                   serve=(conn, base))
    except Exception as e:  # noqa: BLE001 - the parent turns it into the mode's failed row
        try:
            conn.send(("error", _reason(e)))
        except (OSError, ValueError):  # the parent is gone
            pass


def _serve(s: Side, device, conn) -> None:
    """In a side's process, after its first call: report what the parent's rows need, then answer until ``('stop',)``
    or the pipe closes: ``('time', warmup, n)`` -> ``(median ms, [host ms per run])`` (at least one untimed forward
    first: the first after another process ran is slower), ``('fill',)`` -> the fills replayed alone (ms)."""
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


def spawn_sides(args, device: torch.device, mode_text: str, sides: list[Side], base: torch.nn.Module, run) -> None:
    """``--side-processes``: start one process per side of ``mode_text`` at once (:func:`_serve_side`) and fill in
    each side from its report; :func:`_time_sides` then times them through their pipes. Raises as :func:`_recv` does
    (the first side to fail; :func:`stop_sides` ends the others)."""
    import multiprocessing
    from multiprocessing.connection import wait

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions that share base's weights

    ctx = multiprocessing.get_context("spawn")
    for s in sides:
        s.conn, theirs = ctx.Pipe()
        p = ctx.Process(target=_serve_side, args=(vars(args), str(device), mode_text, s.name, theirs, base,
                                                  os.getpid(), run), daemon=True)
        try:
            p.start()
        finally:
            theirs.close()
        s.proc, s.ask = p, functools.partial(_ask, s)  # only a started process (stop_sides joins it)
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
    """End the sides' processes (asked; those still busy after :data:`STOP_GRACE_S`, e.g. compiling when another
    side failed, are killed); a no-op for sides in this process."""
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
    end = time.monotonic() + STOP_GRACE_S
    for s in sides:
        if s.proc is None:
            continue
        s.proc.join(max(0.0, end - time.monotonic()))
        if s.proc.is_alive():
            s.proc.kill()
            s.proc.join(5)
        s.conn.close()
        s.proc = s.conn = s.ask = None
    if any_cuda:  # the weights the stopped processes mapped, released on this (the producing) side too
        torch.cuda.ipc_collect()


def precompile(args, device: torch.device, sides_for, run) -> None:
    """``--compile-workers N``: every side of every compiled mode built and called once in child processes, up to N at
    a time (each with its own weights), so this process's own compiles are mostly cache hits. A child that fails or
    dies is reported (its side is built here as usual). Skipped, saying so, where Inductor's FX graph cache is off."""
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
            for s in sides_for(args, None, None)]
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
                p = ctx.Process(target=_compile_one, args=(vars(args), str(device), *job, results, run), daemon=True)
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
