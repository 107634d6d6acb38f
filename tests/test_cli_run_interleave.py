"""`cp-ops run`'s interleaved rounds (cp_ops/cli/run.py::_can_interleave/_interleaved): the model copies kept for
the rounds are freed once the rounds are over (before --profile and the report), and ranks that disagree on the
room for the copies all time one side at a time, rank 0 saying why whichever rank lacked the room."""

import argparse
import gc
import json
import os
import weakref

import torch

from dist_util import run_ranks


def _ns(**kw):
    base = dict(model="wan", config="tiny", checkpoint=None, layers=None, frames=2, height=16, width=16, text_tokens=16,
                batch=1, dtype="fp32", mode="agkv", transport="torch", chunks=None, compile=None, no_overlap=False,
                cuda_graphs=False, steps=0, cfg=False, compare=None, profile=None, profile_runs=1, warmup=0,
                repeats=2, out=None, settings={})
    base.update(kw)
    return argparse.Namespace(**base)


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
        run_module.run_model(rank, world_size, torch.device("cpu"), _ns())
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
    for r in (r0, r1):
        assert r["interleave_short0"] is False and r["interleave_short1"] is False
    msg = "too little free GPU memory to keep every side's model for interleaved timing"
    assert r0["stdout"].count(msg) == 2, r0["stdout"]  # rank 0 says so whether it or a peer lacked the room
    assert msg not in r1["stdout"]
