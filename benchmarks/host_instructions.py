"""Host instructions per eager ``cp_ops.attention`` call, counted by valgrind's callgrind: a count that does not move
with the machine's load, for before/after comparisons of 1-2 % that wall or CPU time cannot resolve on a shared box.

    python benchmarks/host_instructions.py [--base DIR] [--calls 500] [--runs 3] [--cases default,agkv:1,...]

Per case (mode:chunks, or ``default``: mode, transport and chunks left to cp_ops, the defaults of ``cp_ops.attention``
and ``cp_ops.parallelize``; plus ``+check`` for the rank contract's exchange), a child process makes 50 calls of
``cp_ops.attention`` at a tiny CPU shape ([1, 16, 8, 16] fp32), then ``--calls`` more inside one ``functools.reduce``;
callgrind counts only inside it (``--toggle-collect=functools_reduce``). Without ``+check``: one process, a fake W = 2
group (no exchange, no data moved). With ``+check``: two processes over gloo, the fake CP group with the exchange on
(``check_ranks='once'``), rank 0 counted under valgrind while rank 1 runs natively, so rank 0's peer is always there
first (the path of a rank that never waits). One tree's count moves by up to ~0.6 % between runs whose environment
(and so memory layout) differs: each case runs ``--runs`` times with another environment size, and the table shows
the mean and the spread. ``--base DIR``: an older checkout's ``cp_ops`` counted
the same way, for the change in %. Needs valgrind; about a minute per run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys

CASES = "default,agkv:1,agkv:2,ulysses:1,ulysses:2,default+check,agkv:1+check,ulysses:1+check"


def _child(rank: int, mode: str, chunks: int, calls: int, check: bool, port: str) -> None:
    import functools

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if check:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the 'fake' backend)
        from torch._C._distributed_c10d import FakeWork

        FakeWork.is_completed = lambda self: True  # as benchmarks/host_cost.py --fake: done at launch
        group = dist.new_group([0, 1], backend="fake")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        group = None
    import cp_ops
    from cp_ops import config

    try:
        from cp_ops import contract
    except ImportError:  # an older checkout
        from cp_ops import validate as contract
    if check:
        contract._state(group).skip = False  # real processes: the exchange runs as on real ranks
        config.configure(check_ranks="once")
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 16, 8, 16, generator=g) for _ in range(3))

    if mode == "default":  # mode, transport and chunks left to cp_ops
        def call(acc, _):
            return cp_ops.attention(q, k, v, group=group) is None
    else:
        def call(acc, _):
            return cp_ops.attention(q, k, v, group=group, mode=mode, transport="torch", chunks=chunks) is None

    with torch.no_grad():
        for i in range(50):  # first calls (plans, checks): not counted
            call(0, i)
        functools.reduce(call, range(calls), 0)  # counted: callgrind collects inside functools.reduce only
    if check:
        dist.barrier()
    dist.destroy_process_group()


def _count(tree: str, case: str, calls: int, port: int, pad: int) -> float:
    """Instructions per call of ``case`` with ``tree``'s cp_ops first on the path; ``pad``: the length of an unused
    environment variable (it moves the process's first allocations, so repeated runs sample the layouts)."""
    name, check = case.removesuffix("+check"), case.endswith("+check")
    mode, chunks = name.split(":") if ":" in name else (name, "0")
    env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", CP_OPS_TIMEOUT_S="600",
               HOST_INSTRUCTIONS_PAD="x" * pad)
    a = [__file__, "--child", mode, chunks, str(calls), str(int(check)), str(port)]
    peer = subprocess.Popen([sys.executable, *a, "1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL) if check else None
    try:
        r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", "--collect-atstart=no",
                            "--toggle-collect=functools_reduce", sys.executable, *a, "0"],
                           env=env, capture_output=True, text=True, timeout=1800)
    finally:
        if peer is not None:
            peer.wait(timeout=60)
    m = re.search(r"Collected : (\d+)", r.stderr)
    if m is None:
        raise RuntimeError(f"{case} ({tree}): callgrind gave no count:\n{r.stderr[-2000:]}")
    return int(m.group(1)) / calls


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        mode, chunks, calls, check, port, rank = sys.argv[2:8]
        _child(int(rank), mode, int(chunks), int(calls), check == "1", port)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=None, help="an older checkout (its cp_ops/ folder's parent) to compare with")
    ap.add_argument("--calls", type=int, default=500, help="counted calls per run (default 500)")
    ap.add_argument("--runs", type=int, default=3, help="runs per case and tree, each with another environment size "
                    "(default 3): the mean is shown, and the spread (max - min) in %% of it")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once (default: the CPU count)")
    ap.add_argument("--cases", default=CASES, help=f"mode:chunks or 'default', each [+check] (default {CASES})")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("this", here)] + ([("base", os.path.abspath(args.base))] if args.base else [])
    cases = args.cases.split(",")
    print(f"instructions per eager call (callgrind), {args.calls} calls x {args.runs} runs, [1, 16, 8, 16] fp32 on CPU")
    head = " ".join(f"{t:>12} {'spread':>7}" for t, _ in trees)
    print(f"{'case':>16} {head}" + ("      change" if args.base else ""))
    runs = [(c, t, path, r) for c in cases for r in range(args.runs) for t, path in trees]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:  # each run its own port pair
        jobs = {(c, t, r): pool.submit(_count, path, c, args.calls, 29500 + 2 * n, 1 + 4099 * r)
                for n, (c, t, path, r) in enumerate(runs)}
        for c in cases:
            got = []
            for t, _ in trees:
                xs = [jobs[(c, t, r)].result() for r in range(args.runs)]
                got.append((sum(xs) / len(xs), 100 * (max(xs) - min(xs)) / (sum(xs) / len(xs))))
            change = f"  {100 * (got[0][0] / got[1][0] - 1):+9.1f} %" if args.base else ""
            print(f"{c:>16} " + " ".join(f"{m / 1e3:11.1f}k {s:6.2f}%" for m, s in got) + change, flush=True)


if __name__ == "__main__":
    main()
