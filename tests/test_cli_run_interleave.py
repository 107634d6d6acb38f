"""`cp-ops run`'s interleaved rounds (cp_ops/cli/run.py::_can_interleave/_interleaved): the model copies kept for
the rounds are freed once the rounds are over (before --profile and the report), and ranks that disagree on the
room for the copies all time one side at a time, rank 0 saying why whichever rank lacked the room."""

import gc
import json
import os
import weakref

import torch

from dist_util import run_ranks


def _ns(**kw):
    """test_cli_run's run arguments, with AGKV and 2 interleaved rounds."""
    from test_cli_run import _ns as base

    return base(**{"mode": "agkv", "repeats": 2, **kw})


def _body(rank, world_size, outdir):
    import contextlib
    import copy
    import io
    import types

    import cp_ops.cli.run as run_module

    copies = []

    def deepcopy(x, *a, **k):
        y = copy.deepcopy(x, *a, **k)
        if isinstance(y, torch.nn.Module):
            copies.append(weakref.ref(y))
        return y

    run_module.copy = types.SimpleNamespace(deepcopy=deepcopy)
    seen = {}
    real_report = run_module.report

    def report(*a, **k):  # after the rounds and --profile: no kept copy may still be referenced
        gc.collect()
        seen["copies"] = len(copies)
        seen["alive"] = sum(r() is not None for r in copies)
        return real_report(*a, **k)

    run_module.report = report
    out = {}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        # --compare on CPU: diffusers' rows are skipped (with their reason) and left out of the rounds
        run_module.run_model(rank, world_size, torch.device("cpu"),
                             _ns(compare="diffusers", out=os.path.join(outdir, "run.json")))
        out["free"] = dict(seen)
        # the room check disagrees: rank 0 alone lacks it (then rank 1 alone): every rank times one side at a time
        for short in (0, 1):
            run_module._room_for_copies = lambda *a, short=short, **k: rank != short
            out[f"interleave_short{short}"] = run_module._can_interleave(None, _ns(), torch.device("cpu"))
    out["stdout"] = buf.getvalue()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def test_kept_copies_freed_and_room_check_agrees(tmp_path):
    run_ranks(_body, 2, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["free"] == {"copies": 1, "alive": 0}, r0["free"]  # the 1-rank copy, gone before the report
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["1 rank", "diffusers ulysses", "diffusers ring", "cp_ops agkv"]
    assert all(set(r) == {"name", "skipped"} for r in rows[1:3]), rows
    single, cp = rows[0], rows[-1]
    assert single["ms_sequential"] > 0 and cp["ms_sequential"] > 0 and cp["speedup"] == single["ms"] / cp["ms"]
    for r in (r0, r1):
        assert r["interleave_short0"] is False and r["interleave_short1"] is False
    msg = "too little free GPU memory to keep every side's model for interleaved timing"
    assert r0["stdout"].count(msg) == 2, r0["stdout"]  # rank 0 says so whether it or a peer lacked the room
    assert msg not in r1["stdout"]


def test_regional_compile_stays_static_across_sides(monkeypatch):
    """Every side compiles with static shapes: in the interleaved rounds rank 0's 1-rank model (all tokens) compiles
    again beside the CP model (its shard's tokens) in one Dynamo frame; with automatic dynamic shapes that second
    compile would be a symbolic-shape graph, not the one the first measurement timed. Two tiny Wan models at
    different token counts through compile_model (Dynamo with a recording backend): no graph gets a symbolic size."""
    import cp_ops
    from cp_ops.cli.models import MODELS, build
    from cp_ops.cli.run import compile_model

    graphs = []

    def record(gm, example_inputs):
        vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append(sum(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(
            isinstance(s, torch.SymInt) for s in v.shape)) for v in vals))  # inputs with a symbolic size
        return gm.forward

    def fake_compile(fn, overlap=True, **kw):
        return torch.compile(fn, backend=record, **kw)

    monkeypatch.setattr(cp_ops, "compile", fake_compile)
    spec = MODELS["wan"]
    torch._dynamo.reset()
    try:
        for hw in (16, 8):  # 128 then 32 tokens: the same block class, so the same Dynamo frame
            model, cfg = build(spec, "tiny", 1, "cpu", torch.float32)
            kw = spec.make_inputs(cfg, 16, 1, 2, hw, hw, "cpu", torch.float32, torch.Generator().manual_seed(0))
            m, n = compile_model(model, spec, _ns(compile="regional"), overlap=False)
            with torch.no_grad():
                spec.predict(m, kw)
            assert n == 1
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 2, graphs
    assert graphs == [0, 0], graphs
