"""The overlap pass is all or nothing: a failure partway leaves the graph exactly as it was (that launch keeps its
place, a warning says why; STRICT: an error after the restore), a result that breaks the in-flight bound is undone
whole, and the scheduler pass removes the ordering dependencies it added when it fails partway.

Failures are injected into the pass's steps (monkeypatch): before the rollback, an AGKV launch failing after its
window was opened stayed half-moved, a Ulysses launch failing after its split stayed split, and a broken bound
was only warned about, with a message claiming the fast transport would raise (its guard tracks waits, not reads).
"""

from __future__ import annotations

import logging

import pytest
import torch

import cp_ops  # noqa: F401
import cp_ops.passes.overlap as ov
from cp_ops import passes
import blocks as pb
from pass_util import fake_group  # noqa: F401  (fixture)
from test_pass_inflight import _events, _repro_graph

DIM, HEADS = 64, 4


def _wan_args(s_local=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, s_local, DIM, generator=g)
    cos, sin = pb.rope_tables((2, 4, 4), DIM // HEADS, 0, s_local)
    return x, cos, sin


def _traced(model):
    """``model``'s post-grad-like graph in model order (make_fx, fake tensors; as test_pass_graph traces)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    params = {k: v.detach() for k, v in model.named_parameters()}

    def fn(params, *args):
        return torch.func.functional_call(model, params, args)

    with torch.no_grad():
        return make_fx(fn, tracing_mode="fake")(params, *_wan_args())


def _state(graph, val: bool = True) -> list[tuple]:
    """Every node in order with its inputs, the pass's tags and (``val``) its fake value (the object: a split's
    rewired selects get new ones; two traces of a model have different ones): what "as it was" means, exactly."""
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), n.meta.get(ov.TAG), n.meta.get(ov.AFTER),
             id(n.meta.get("val")) if val else None) for n in graph.nodes]


def _boom(*a, **k):
    raise RuntimeError("injected failure")


def _fail_after(fn, ok_calls: int):
    calls = []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) > ok_calls:
            raise RuntimeError("injected failure")
        return fn(*a, **k)

    return wrapped


@pytest.mark.parametrize("mode, step", [
    ("agkv", "_sink_wait"),  # after the window was opened: the launch and the Q side had moved
    ("agkv", "_window_nodes"),  # after the waits sank, before tagging
    ("ulysses", "_open_window"),  # after [q, k, v] was split into [k, v] + [q]
])
def test_failure_partway_leaves_the_graph_as_it_was(monkeypatch, caplog, mode, step):
    torch.manual_seed(0)
    gm = _traced(pb.WanBlock(DIM, HEADS, mode=mode))
    before = _state(gm.graph)
    monkeypatch.setattr(ov, "STRICT", False)
    monkeypatch.setattr(ov, step, _boom)
    with caplog.at_level("WARNING", logger="cp_ops.passes"):
        assert ov.overlap_kv_communication(gm.graph) == 0
    assert _state(gm.graph) == before
    gm.graph.lint()
    assert ": RuntimeError: injected failure (its rewrite undone" in caplog.text
    monkeypatch.setattr(ov, "STRICT", True)
    with pytest.raises(RuntimeError, match="injected failure"):
        ov.overlap_kv_communication(gm.graph)
    assert _state(gm.graph) == before  # restored before raising
    gm.graph.lint()


def test_failure_in_a_later_launch_keeps_the_earlier_windows(monkeypatch, caplog):
    """Two layers: the second launch fails after its window opened; the first layer's window stays, the second
    launch is exactly where a pass that skipped it would leave it."""
    torch.manual_seed(0)
    model = pb.Stack(DIM, HEADS, layers=2)
    monkeypatch.setattr(ov, "STRICT", False)
    reference = _traced(model)  # the pass run on the first launch only: what the failed second must leave
    launches = [n for n in reference.graph.nodes if n.op == "call_function" and n.target in ov._KV_LAUNCHES]
    assert len(launches) == 2
    ov._process_launch(reference.graph, launches[0], 0, [])
    gm = _traced(model)
    monkeypatch.setattr(ov, "_sink_wait", _fail_after(ov._sink_wait, 2))  # the first launch's two waits (K, V)
    with caplog.at_level("WARNING", logger="cp_ops.passes"):
        assert ov.overlap_kv_communication(gm.graph) == 1
    assert _state(gm.graph, val=False) == _state(reference.graph, val=False)
    assert caplog.text.count("its rewrite undone") == 1


def test_broken_inflight_bound_undoes_the_whole_pass(monkeypatch, caplog):
    """Without the bound's placement the pass would put three launches of one key in flight (the repro); the
    final check finds it, and the graph runs as traced: no window, no claim that the runtime would catch it."""
    gm = _repro_graph()
    before = _state(gm.graph)
    assert ov.check_inflight(gm.graph) == []  # as traced: each launch read before the next
    monkeypatch.setattr(ov, "STRICT", False)
    monkeypatch.setattr(ov, "_inflight_bound", lambda graph, launch, limit: [])  # a placement bug
    with caplog.at_level("WARNING", logger="cp_ops.passes"):
        assert ov.overlap_kv_communication(gm.graph) == 0
    assert _state(gm.graph) == before
    assert _events(gm.graph) == ["launch:0", "read:0", "launch:1", "read:1", "launch:2", "read:2"]
    assert "overlap pass undone, the graph runs as traced" in caplog.text
    assert "agkv_gather_start_2 runs before the output of" in caplog.text
    assert "will raise" not in caplog.text
    monkeypatch.setattr(ov, "STRICT", True)
    with pytest.raises(RuntimeError, match="pool slot of an output not yet read"):
        ov.overlap_kv_communication(gm.graph)
    assert _state(gm.graph) == before


def test_no_place_for_a_launch_leaves_it_as_traced(monkeypatch, caplog):
    """A launch with no place that keeps the bound gets no window (its rewrite undone), the others keep theirs."""
    gm = _repro_graph()
    real = ov._inflight_bound
    monkeypatch.setattr(ov, "STRICT", False)
    monkeypatch.setattr(ov, "_inflight_bound", lambda graph, launch, limit: None if launch.name.endswith("_2")
                        else real(graph, launch, limit))
    with caplog.at_level("WARNING", logger="cp_ops.passes"):
        assert ov.overlap_kv_communication(gm.graph) == 2
    assert "no overlap window for agkv_gather_start_2: _NoWindow" in caplog.text and "its rewrite undone" in caplog.text
    assert ov.check_inflight(gm.graph) == []
    assert _events(gm.graph)[-2:] == ["launch:2", "read:2"]


def _deps(snodes) -> dict[str, tuple]:
    return {sn.get_name(): (sorted(map(str, sn.read_writes.reads)), sorted(map(str, sn.unmet_dependencies)),
                            sorted(getattr(sn, "ancestors", ()) or ())) for sn in snodes}


@pytest.mark.usefixtures("inductor_kernels")  # the scheduler nodes the pass pins
def test_scheduler_pass_failure_removes_the_dependencies_it_added(monkeypatch, caplog, fake_group):
    """Two windows; pinning the second fails after the first was pinned: every scheduler node's dependencies
    (and ancestors) are back to what they were, the nodes come back in their order, with a warning."""
    import torch._inductor.config as cfg
    from torch._inductor.utils import get_code

    import cp_ops.passes.pin as pin

    seen = {}

    class Recorder(passes.PinWindows):
        def __call__(self, snodes):
            seen["before"], seen["order"] = _deps(snodes), [sn.get_name() for sn in snodes]
            out = super().__call__(snodes)
            seen["after"], seen["out"] = _deps(out), [sn.get_name() for sn in out]
            return out

    real_add = pin._weak_dep
    added = []
    monkeypatch.setattr(pin, "_weak_dep", lambda *a: added.append(a) or real_add(*a))
    monkeypatch.setattr(ov, "STRICT", False)
    monkeypatch.setattr(pin, "_gather_window", _fail_after(pin._gather_window, 1))
    opts = passes.inductor_options()
    opts["_pre_fusion_custom_pass"] = Recorder()
    torch._dynamo.reset()
    # scheduled and its code generated (where the pass pins), not built (its C++ kernels) or run
    with caplog.at_level("WARNING", logger="cp_ops.passes"), torch.no_grad(), cfg.patch(fx_graph_cache=False):
        x, cos, sin = _wan_args()
        get_code(torch.compile(pb.Stack(DIM, HEADS, layers=2), fullgraph=True, options=opts), x, cos, sin)
    torch._dynamo.reset()
    assert added, "the first window was not pinned: the failure was not partway"
    assert "windows not pinned in the scheduler (its dependencies undone" in caplog.text
    assert seen["out"] == seen["order"]
    assert seen["after"] == seen["before"]
