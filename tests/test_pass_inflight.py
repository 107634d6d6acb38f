"""The overlap pass never puts a launch on a pool slot whose output is still unread, and plain
``torch.compile`` (``cp_ops.passes`` never imported) still gets the launches' Inductor lowerings.

A pooling transport (fast) gives each (op, shape, dtype) key ``inflight_limit()`` = 2 output slots, taken in
turn: launch i of a key writes where launch i - 2 wrote. ``shared/repros/pass_three_inflight.py``: three K/V
launches ready before the first attention; raised to right after their inputs, the third overwrote the first's
K/V before attention 0 read them. Numbers (a pooled stand-in transport on gloo): test_pass_correctness.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import cp_ops
import blocks as pb
from cp_ops.transport.base import inflight_limit
from pass_util import compile_and_get, fake_group, pool_slot_violations  # noqa: F401  (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIM, HEADS = 64, 4



def _repro_graph():
    """The repro's function, traced with make_fx (model order: the three K/V projections first)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(w, x0, x1, x2):
        xs = (x0, x1, x2)
        kv = [((x @ w).unflatten(-1, (4, 16)), (x @ w.T).unflatten(-1, (4, 16))) for x in xs]
        outs = [cp_ops.attention((x * 2.0).unflatten(-1, (4, 16)), k, v, mode="agkv", transport="torch")
                for x, (k, v) in zip(xs, kv)]
        return torch.cat(outs, 1)

    args = [torch.randn(64, 64)] + [torch.randn(1, 8, 64) for _ in range(3)]
    with torch.no_grad():
        return make_fx(fn, tracing_mode="fake")(*args)


def _events(graph) -> list[str]:
    """launch:i / read:i (attention i) in graph order, i = the launch's traced index."""
    launches = [n for n in graph.nodes if n.op == "call_function" and "agkv_gather_start" in str(n.target)]
    idx = {n.name: i for i, n in enumerate(launches)}
    out = []
    for n in graph.nodes:
        if n in launches:
            out.append(f"launch:{idx[n.name]}")
        elif n.op == "call_function" and "scaled_dot_product" in str(n.target):
            out.append(f"read:{sum(e.startswith('read') for e in out)}")
    return out


def test_repro_graph_third_launch_after_first_read():
    import cp_ops.passes.overlap as ov

    assert inflight_limit() == 2
    gm = _repro_graph()
    with mock.patch.object(ov, "STRICT", True):
        assert ov.overlap_kv_communication(gm.graph) == 3
    # Launches 0 and 1 rise to right after their K/V (both in flight); launch 2 waits for attention 0.
    assert _events(gm.graph) == ["launch:0", "launch:1", "read:0", "launch:2", "read:1", "read:2"]
    assert ov.check_inflight(gm.graph) == []


def test_pool_slot_check_reads_generated_code():
    """pool_slot_violations (used on the compiled 2-layer block below) finds a launch that takes an unread slot."""
    launch = "        buf{o} = torch.ops.cp_ops.agkv_gather_start.default(buf0, buf1, 2, '0', 'torch')\n" \
             "        buf{a} = buf{o}[0]\n        buf{b} = buf{o}[1]\n"
    read = "        buf{r} = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, buf{a}, buf{b})\n"
    l0, l1, l2 = (launch.format(o=o, a=o + 1, b=o + 2) for o in (10, 20, 30))
    r0, r1, r2 = (read.format(r=o + 5, a=o + 1, b=o + 2) for o in (10, 20, 30))
    assert pool_slot_violations(l0 + l1 + r0 + l2 + r1 + r2, "agkv_gather_start") == []
    bad = pool_slot_violations(l0 + l1 + l2 + r0 + r1 + r2, "agkv_gather_start")
    assert len(bad) == 1 and "['buf11', 'buf12']" in bad[0], bad


def test_repro_graph_unbounded_is_caught():
    """Without the bound the pass reproduces the fault, and check_inflight (run at the end of every pass,
    STRICT: an error) names it: the check cannot pass vacuously."""
    import cp_ops.passes.overlap as ov

    gm = _repro_graph()
    with mock.patch.object(ov, "inflight_limit", lambda: None):
        ov.overlap_kv_communication(gm.graph)
    assert _events(gm.graph)[:3] == ["launch:0", "launch:1", "launch:2"]
    bad = ov.check_inflight(gm.graph, 2)
    assert len(bad) == 1 and bad[0].startswith("agkv_gather_start_2 runs before the output of"), bad


@pytest.mark.usefixtures("inductor_kernels")  # the order in the generated code
def test_two_layer_block_order_in_graph_and_code():
    """Compiled with Inductor: in each of two layers the third K/V launch follows the reads of the first two
    (its slot is the first launched's), in the FX graph and in the generated code (the scheduler keeps it:
    an ordering dependency). The numbers (bitwise equal to eager): test_pass_correctness.py."""
    model = pb.KVFirstStack(DIM, HEADS, layers=2)
    _, code, cap, logs = compile_and_get(model, (torch.randn(3, 1, 8, DIM),))
    assert cap.windows == [6]
    placed = [m for m in logs if "placed after" in m]
    assert len(placed) == 2, logs
    assert any(" pinned after " in m for m in logs), logs
    # FX graph (the pass itself checks the pool turns at its end: STRICT raises): per layer, two launches go
    # before the first attention (the window stays open), then the bound places the third.
    fx_order = [
        "L" if rhs.startswith("cp_ops.agkv_gather_start(") else "R"
        for rhs in (l.split(" = ", 1)[1] for l in cap.after[0].splitlines())
        if rhs.startswith(("cp_ops.agkv_gather_start(", "_scaled_dot_product"))
    ]
    assert len(fx_order) == 12 and fx_order[:2] == fx_order[6:8] == ["L", "L"], cap.after[0]
    # Generated code: the same in kernel order, and no launch takes a pool slot whose output a later line reads.
    code_order = ["L" if "cp_ops.agkv_gather_start.default(" in l else "R"
                  for l in code.splitlines() if "cp_ops.agkv_gather_start.default(" in l
                  or "_scaled_dot_product_flash_attention_for_cpu.default(" in l]
    assert code_order == fx_order, code
    assert pool_slot_violations(code, "agkv_gather_start") == [], code


def test_plain_torch_compile_gets_lowerings_without_importing_passes():
    """``import cp_ops`` imports no ``cp_ops.passes``; plain ``torch.compile`` (the pass never imported by the
    user) still lowers the launches as collectives (their inputs stay alive until the wait): cp_ops' fake kernels
    import the lowerings lazily on the first trace."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{os.path.join(ROOT, "tests")!r}, {ROOT!r}]
        import torch, torch.distributed as dist
        import cp_ops
        assert not [m for m in sys.modules if m.split(".")[:2] == ["cp_ops", "passes"] or m.split(".")[0] == "passes"], "import cp_ops imported the pass"
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch._inductor.utils import get_code
        import blocks as pb
        from pass_util import check_inputs_alive, call_section
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        x = torch.randn(1, 16, {DIM})
        cos, sin = pb.rope_tables((2, 4, 4), {DIM // HEADS}, 0, 16)
        with torch.no_grad():  # the generated code, not built (its C++ kernels) or run: it is what is checked
            codes = get_code(torch.compile(pb.WanBlock({DIM}, {HEADS}, mode="agkv"), fullgraph=True), x, cos, sin)
        check_inputs_alive(call_section(codes[0]), "agkv_gather_start", 2)
        assert "cp_ops.passes.lowering" in sys.modules
        print("OK")
        """
    )
    env = dict(os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="0")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-3000:] + r.stderr[-3000:]
