"""`cp-ops run`'s legend says how the times were taken: "in interleaved rounds" only when the rows were re-timed in
rounds (cp_ops.cli.run._interleaved left ms_sequential in them); a run that could not interleave (on CUDA: too
little free memory for the 1-rank copy) says its sides were timed one after another."""

import argparse
import contextlib
import io

import torch

from cp_ops.cli.models import MODELS, build
from cp_ops.cli.run import report


def _legend(rows) -> str:
    args = argparse.Namespace(model="wan", config="tiny", checkpoint=None, layers=None, frames=2, height=16, width=16,
                              text_tokens=16, batch=1, dtype="fp32", mode="agkv", transport="torch", chunks=None,
                              compile=None, no_overlap=False, cuda_graphs=False, steps=0, cfg=False, compare=None,
                              repeats=7, out=None)
    spec = MODELS["wan"]
    _, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report(args, spec, cfg, torch.device("cpu"), 2, 128, "agkv", "torch", rows, None, 0)
    return next(line for line in out.getvalue().splitlines() if line.startswith("speedup = "))


def test_legend_follows_what_was_measured():
    single = dict(name="1 rank", ms=3.0, first_call_s=0.01, compile_s=0.0)
    cp = dict(name="cp_ops agkv", ms=2.0, first_call_s=0.02, compile_s=0.0, max_rel_err=0.0, speedup=1.5)
    sequential = _legend([dict(single), dict(cp)])
    assert "times are medians of 7 runs, one side after another (not interleaved)" in sequential, sequential
    assert "interleaved rounds" not in sequential
    interleaved = _legend([dict(single, ms_sequential=3.1), dict(cp, ms_sequential=2.1, speedup_sequential=1.48)])
    assert "times are medians of 7 runs in interleaved rounds (each: the 1-rank model on rank 0 alone" in interleaved
