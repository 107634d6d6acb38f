"""Host time of one ``cp_ops.attention`` call inside a compiled function, against plain SDPA of the same shapes.

What ``cp-ops bound MODEL --worlds W --compile-modes regional --cost`` compares per attention call, at a tiny shape
(the device work a few µs), in ONE process over a fake group of W ranks (``torch.testing._internal.distributed.
fake_pg``, this process rank 0 of each), its collectives' outputs written by :mod:`cp_ops.cli.bound_fill` as
``--bound`` does:

* ``cp``: ``x -> linear -> q, k, v -> cp_ops.attention(q, k, v, group, mode, transport='torch', chunks=1[, key_mask])
  -> reshape``, compiled with ``cp_ops.compile(fullgraph=True, dynamic=False)`` (``overlap``) or plain
  ``torch.compile`` (``no overlap``);
* ``plain``: the same function with SDPA of the shapes rank 0 computes (as ``cp_ops.cli.bound_sides.PlainAttention``:
  AGKV = local Q against K/V repeated W times; Ulysses = all S tokens and H/W heads, the output's first S_local tokens
  repeated over the heads), compiled with ``torch.compile``.

Host µs per call = the wall time of ``--calls`` calls issued back to back, divided by the calls (median of 7 loops;
on CUDA the loop is waited for after the clock stops: the host's enqueue time), and the thread's CPU time per call
(on a busy machine the wall time includes waiting for a core). ``mask``: a bool every-key mask ``[B, W*S_local]``
(what the diffusers integration passes: no mask gather).

Per row, the guards' cost: the same loop with ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``
(Dynamo's guards not evaluated), subtracted from the normal one (where this torch has the stance).

``--breakdown``: where one call's µs go, each piece timed alone (min over 7 loops): the launch ops through the
dispatcher with their ``wait_tensor``, their Python bodies without the dispatcher, the rank-contract check, the
transport call, the fake group's collective alone, ``_register_work`` + ``wait_tensor``, an
allocation.

``--entries``: Dynamo cache entries. ``--bound`` compiles each block class once per side (diffusers, group of 1, cp
and plain per W, diffusers' CP: up to ~13 entries per code object). A function compiled for K variants (one cache
entry each) is called in runs of ``--run`` calls per variant (a forward's blocks), round robin: µs per call against
K = 1. Dynamo moves the entry that matched to the front of the list, so only the first call of a run walks the
others' guards.

    python benchmarks/host_compiled.py [--device cpu|cuda] [--worlds 2,4,8] [--calls 200] [--breakdown] [--entries]
        [--out DIR]

CPU: about a minute (each row compiles one or two functions). Writes ``host_compiled.json`` under ``--out`` after each
section and compiled row (the sections without compiles run first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _loop_us(fn, calls: int, sync, loops: int = 7) -> tuple[float, float, float]:
    """(median wall, min wall, median thread CPU) µs per call of ``calls`` calls back to back; synced after each
    loop, outside the clock."""
    for _ in range(3):
        fn()
    sync()
    wall, cpu = [], []
    for _ in range(loops):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            fn()
        wall.append((time.perf_counter() - t0) / calls * 1e6)
        cpu.append((time.thread_time() - c0) / calls * 1e6)
        sync()
    return statistics.median(wall), min(wall), statistics.median(cpu)


def _block(lin, shape, w, pg, mode: str, plain: bool, overlap: bool):
    """The compiled block function ``fn(x, mask)`` (see the module docstring)."""
    import cp_ops

    b, s, h, d = shape

    def fn(x, mask):
        q, k, v = lin(x).view(b, s, 3, h, d).unbind(2)
        if plain:
            if mode == "ulysses":
                q, k, v = (t[:, :, : h // w].repeat(1, w, 1, 1) for t in (q, k, v))
            else:
                k, v = k.repeat(1, w, 1, 1), v.repeat(1, w, 1, 1)
            m = None if mask is None else mask[:, None, None, :]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=m).transpose(1, 2)
            if mode == "ulysses":
                o = o[:, :s].repeat(1, 1, w, 1)
        else:
            o = cp_ops.attention(q, k, v, group=pg, mode=mode, transport="torch", chunks=1, key_mask=mask)
        return o.reshape(b, s, h * d)

    if plain or not overlap:
        return torch.compile(fn, fullgraph=True, dynamic=False)
    return cp_ops.compile(fn, fullgraph=True, dynamic=False)


def _no_guards():
    """A context-manager factory for ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (Dynamo's guards not
    evaluated: timed beside the normal call, what they cost), or None where this torch has no such stance. (Called
    outside ``with``, ``set_stance`` would set the stance for good.)"""
    import inspect

    fn = getattr(torch.compiler, "set_stance", None)
    if fn is None or "skip_guard_eval_unsafe" not in inspect.signature(fn).parameters:
        return None
    return lambda: fn(skip_guard_eval_unsafe=True)


def _guards_text(res) -> str:
    g = [res[p].get("guards_us") for p in (False, True)]
    return "" if None in g else f"  guards: cp {g[0]:5.1f} plain {g[1]:5.1f} µs"


def compiled_rows(groups, shape, dtype, device, args, sync, rows: list, on_row=lambda: None) -> list[dict]:
    """The compiled rows (module docstring), appended to ``rows`` one at a time (``on_row()`` after each)."""
    b, s, h, d = shape
    torch.manual_seed(0)
    lin = torch.nn.Linear(h * d, 3 * h * d, device=device, dtype=dtype)
    x = torch.randn(b, s, h * d, device=device, dtype=dtype)
    for mode in args.modes:
        for w in args.worlds:
            if mode == "ulysses" and h % w:
                continue
            for masked in (False, True):
                mask = (torch.rand(b, w * s, device=device) > 0.2) if masked else None
                for overlap in (True, False):
                    res = {}
                    for plain in (False, True):
                        if plain and not overlap:  # the plain side has no cp_ops op: the pass changes nothing
                            res[plain] = rows[-1]["plain"]
                            continue
                        f = _block(lin, shape, w, groups[w], mode, plain, overlap)
                        with torch.no_grad():
                            f(x, mask)
                            r = _loop_us(lambda: f(x, mask), args.calls, sync)
                            g, skip = None, _no_guards()
                            if skip is not None:
                                with skip():
                                    g = _loop_us(lambda: f(x, mask), args.calls, sync)
                        res[plain] = dict(wall_us=r[0], min_us=r[1], cpu_us=r[2],
                                          guards_us=None if g is None else r[1] - g[1])
                    row = dict(mode=mode, world_size=w, mask=masked, overlap=overlap, cp=res[False], plain=res[True],
                               cost_us=res[False]["min_us"] - res[True]["min_us"],
                               cost_cpu_us=res[False]["cpu_us"] - res[True]["cpu_us"])
                    rows.append(row)
                    on_row()
                    print(f"{mode:8} W={w} mask={'every-key' if masked else 'none':9} "
                          f"{'cp_ops.compile' if overlap else 'torch.compile':14}  cp {res[False]['min_us']:7.1f} "
                          f"(cpu {res[False]['cpu_us']:7.1f})  plain {res[True]['min_us']:7.1f} "
                          f"(cpu {res[True]['cpu_us']:7.1f})  cp_ops {row['cost_us']:+7.1f} µs "
                          f"(cpu {row['cost_cpu_us']:+7.1f})" + _guards_text(res), flush=True)
    return rows


def breakdown_rows(groups, shape, dtype, device, args, sync) -> list[dict]:
    """Each piece of the launch ops' host path timed alone (min over 7 loops, µs per call)."""
    from torch._C._distributed_c10d import _register_work

    from cp_ops import contract, ops
    from cp_ops.transport import torch as torch_transport

    b, s, h, d = shape
    wait = torch.ops._c10d_functional.wait_tensor.default
    tr = torch_transport.transport
    rows = []
    for w in args.worlds:
        pg = groups[w]
        name = pg.group_name
        k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype) for _ in range(2))
        send = torch.randn(w, b, s, 2, max(1, h // w), d, device=device, dtype=dtype)
        x = torch.randn(b, w * s, max(1, h // w), d, device=device, dtype=dtype)
        mask = torch.ones(b, s, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        outs = [torch.empty(w * s, h, d, device=device, dtype=dtype) for _ in range(2)]
        ins = [k[0], v[0]]

        def op_agkv():
            kf, vf = torch.ops.cp_ops.agkv_gather_start.default(k, v, w, name, "torch", "cp_ops.attention", 7)
            wait(kf)
            wait(vf)

        def op_packed():
            wait(torch.ops.cp_ops.ulysses_packed_start.default(send, w, name, "torch", "cp_ops.attention", 7, None, 3))

        def op_inverse():
            wait(torch.ops.cp_ops.ulysses_inverse_start.default(x, w, name, "torch", "-", 7))

        def op_mask():
            wait(torch.ops.cp_ops.mask_gather_start.default(mask, w, name))

        work = pg.alltoall_base(recv, send, [], [])

        def register_wait():
            _register_work(recv, work)
            wait(recv)

        pieces = [
            ("op agkv_gather_start + 2 waits", op_agkv),
            ("op ulysses_packed_start + wait", op_packed),
            ("op ulysses_inverse_start + wait", op_inverse),
            ("op mask_gather_start + wait", op_mask),
            ("body agkv_gather_start + 2 waits (no dispatcher)",
             lambda: [wait(t) for t in ops.agkv_gather_start._init_fn(k, v, w, name, "torch", "cp_ops.attention", 7)]),
            ("body ulysses_packed_start + wait", lambda: wait(ops.ulysses_packed_start._init_fn(
                send, w, name, "torch", "cp_ops.attention", 7, None, 3))),
            ("body ulysses_inverse_start + wait",
             lambda: wait(ops.ulysses_inverse_start._init_fn(x, w, name, "torch", "-", 7))),
            ("contract.op_checked (agkv: rules + rank check)",
             lambda: contract.op_checked(pg, "cp_ops::agkv_gather_start", "torch", k,
                                         lambda: ops._check_agkv(k, v, w), 2, call="cp_ops.attention", tag=7)),
            ("transport agkv_start + wait", lambda: tr.agkv_start(k, v, pg)[2].wait()),
            ("transport ulysses_packed_start + wait", lambda: tr.ulysses_packed_start(send, pg)[1].wait()),
            ("transport ulysses_inverse_start + wait", lambda: tr.ulysses_inverse_start(x, pg)[1].wait()),
            ("fake pg allgather_into_tensor_coalesced (K, V) + wait",
             lambda: pg.allgather_into_tensor_coalesced(outs, ins).wait()),
            ("fake pg alltoall_base + wait", lambda: pg.alltoall_base(recv, send, [], []).wait()),
            ("_register_work + wait_tensor", register_wait),
            ("torch.empty_like (send buffer)", lambda: torch.empty_like(send)),
        ]
        for label, fn in pieces:
            with torch.no_grad():
                r = _loop_us(fn, args.calls * 5, sync)
            rows.append(dict(world_size=w, piece=label, min_us=r[1], cpu_us=r[2]))
            print(f"W={w} {label:55} {r[1]:7.2f} µs (cpu {r[2]:7.2f})", flush=True)
    return rows


def entries_rows(args, device, sync) -> list[dict]:
    """µs per call of a compiled function with K cache entries, called in runs of ``args.run`` per variant."""
    x = torch.randn(8, 8, device=device)
    rows = []
    for k in (1, 4, 8, 13):
        torch._dynamo.reset()

        def fn(x, n):
            return (x * n).sin() + n

        f = torch.compile(fn, fullgraph=True, dynamic=False)
        for n in range(k):
            f(x, n)

        def runs():
            for n in range(k):
                for _ in range(args.run):
                    f(x, n)

        r = _loop_us(runs, max(1, args.calls // (k * args.run)), sync)
        rows.append(dict(entries=k, run=args.run, min_us=r[1] / (k * args.run), cpu_us=r[2] / (k * args.run)))
        print(f"cache entries {k:3}, runs of {args.run}: {rows[-1]['min_us']:7.2f} µs per call "
              f"(cpu {rows[-1]['cpu_us']:7.2f})", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--modes", default="agkv,ulysses")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    ap.add_argument("--shape", type=int, nargs=4, metavar=("B", "S_LOCAL", "H", "D"), default=None,
                    help="default 1 16 8 16 fp32 on CPU, 1 128 24 128 bf16 on CUDA")
    ap.add_argument("--breakdown", action="store_true", help="time each piece of the launch ops' host path alone")
    ap.add_argument("--entries", action="store_true", help="per-call cost of K Dynamo cache entries (see above)")
    ap.add_argument("--run", type=int, default=19, help="--entries: calls per variant in a row (a forward's blocks)")
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled rows")
    ap.add_argument("--unwritten", action="store_true", help="leave the fake collectives' outputs unwritten")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: kernels run on the timed thread)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.worlds = [int(x) for x in args.worlds.split(",")]
    args.modes = args.modes.split(",")
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    shape = tuple(args.shape or ((1, 128, 24, 128) if cuda else (1, 16, 8, 16)))
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(device.index or 0)  # ("cuda" has no index: set_device refuses it)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    from cp_ops.cli.bound import fake_groups

    created = not dist.is_initialized()
    groups = fake_groups(args.worlds, filled=not args.unwritten)
    written = not args.unwritten
    key = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, key, 256)
    print(f"host µs per call, {device.type}{' ' + torch.cuda.get_device_name(device) if cuda else ''}, torch "
          f"{torch.__version__}, shape B,S_local,H,D = {shape} {dtype}, fake group (rank 0 of W), outputs "
          f"{'unwritten' if args.unwritten else 'written (cp_ops.cli.bound_fill)'}",
          flush=True)
    out = dict(device=device.type, gpu=torch.cuda.get_device_name(device) if cuda else None, torch=torch.__version__,
               shape=list(shape), dtype=str(dtype), calls=args.calls, written=written)
    def save():  # after every section: a run killed at its time limit keeps the sections done
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "host_compiled.json"), "w") as f:
                json.dump(out, f, indent=1)

    try:  # the sections without compiles first (seconds), the compiled rows (two compiles a row) last
        if args.breakdown:
            out["breakdown"] = breakdown_rows(groups, shape, dtype, device, args, sync)
            save()
        if args.entries:
            out["entries"] = entries_rows(args, device, sync)
            save()
        if not args.no_compiled:
            compiled_rows(groups, shape, dtype, device, args, sync, out.setdefault("compiled", []), save)
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
