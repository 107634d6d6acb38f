"""`cp-ops bound MODEL --worlds W --steps N` and `--compare diffusers` (cp_ops.cli.bound, bound_diffusers) on
the tiny configs, one CPU, fake groups of 2 and 4 ranks: the loop's rows (steps run, per-step and total times, the
extrapolation to the model's standard count, no final-latents error from a fake group, said why), and diffusers' own
CP as a side of the same rounds — refused on a CPU-only torch with its reason, and, with the accelerator count
patched to 1 (diffusers' only CPU obstacle), its Ulysses rows measured with the all-to-alls written."""

import argparse
import math

import pytest
import torch
import torch.distributed as dist

from cp_ops.cli import bound, bound_diffusers, bound_report, bound_sides
from cp_ops.cli.main import main
from cp_ops.cli.models import MODELS


def _args(model, **kw):
    f, h, w = MODELS[model].cpu_latent
    base = dict(model=model, config="tiny", checkpoint=None, layers=None, frames=f, height=h, width=w,
                text_tokens=16, batch=1, dtype="fp32", mode="auto", chunks=1, bound=[2, 4],
                bound_compile=["eager"], cost=False, no_group1=True, profile=None, warmup=0, repeats=1, out=None,
                unwritten=False, steps=0, compare=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_bound_steps_loop_rows():
    """--steps 3 on Wan tiny over fake groups of 2 and 4: every side times whole loops; rows say 3 steps run,
    ms/step = total / 3, the totals extrapolated to Wan's 50 steps, and no final-latents error (the note points to
    real ranks and CP_OPS_EMULATE_COMM). run_bound itself checks every side's final latents: the full shape,
    finite on the cp_ops sides (the fake collectives write real data)."""
    rows = bound.run_bound(_args("wan", steps=3), torch.device("cpu"))
    assert not dist.is_initialized()
    assert [r["world_size"] for r in rows] == [2, 4]
    for r in rows:
        assert r["steps"] == 3 and r["steps_run"] == 3 and len(r["rank0_step_samples_ms"]) == 3
        assert r["total_ms"] == r["rank0_ms"] and r["step_ms"] == pytest.approx(r["rank0_ms"] / 3)
        assert r["one_gpu_step_ms"] == pytest.approx(r["one_gpu_ms"] / 3)
        assert math.isfinite(r["bound_speedup"]) and r["bound_speedup"] > 0
        assert r["standard_steps"] == 50 and r["total_standard_ms"] == pytest.approx(r["step_ms"] * 50)
        assert r["max_rel_err"] is None and "CP_OPS_EMULATE_COMM" in r["max_rel_err_note"]
        # a loop's fake writes: the forward's, once per step
        assert r["fills"] > 0 and r["fills"] % 3 == 0


def test_bound_steps_cli(capsys):
    assert main(["bound", "zimage", "--device", "cpu", "--worlds", "2", "--steps", "2", "--repeats", "1",
                 "--warmup", "0", "--no-group1"]) == 0
    text = capsys.readouterr().out
    assert "a denoising loop of 2 steps" in text and "ms/step" in text and "CP_OPS_EMULATE_COMM" in text, text
    assert "2 of 8 steps timed" in text, text


def test_bound_compare_diffusers_refused_on_cpu_only_torch():
    """A CPU-only torch: diffusers' enable_parallelism cannot place a rank (device count 0): each diffusers side is
    a row with that reason, cp_ops' rows are measured as without --compare."""
    rows = bound.run_bound(_args("flux", compare="diffusers"), torch.device("cpu"))
    impls = [(r["world_size"], r["impl"]) for r in rows]
    assert impls == [(2, "cp_ops"), (2, "diffusers ulysses"), (2, "diffusers ring"),
                     (4, "cp_ops"), (4, "diffusers ulysses"), (4, "diffusers ring")]
    for r in rows:
        if r["impl"] == "cp_ops":
            assert math.isfinite(r["bound_speedup"]) and "skipped" not in r
        else:
            assert "needs an accelerator" in r["skipped"], r


def test_bound_compare_diffusers_ulysses_measured(monkeypatch):
    """With the accelerator count patched to 1, diffusers' CP runs on the CPU fake groups: its Ulysses rows carry a
    finite bound, the full output shape, finite outputs (its all-to-alls written with real data) and the writes
    recorded (4 all-to-alls per attention + the output gather); its ring rows either run or name why not (on CPU
    the native backend has no LSE)."""
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    rows = bound.run_bound(_args("flux", compare="diffusers", steps=0), torch.device("cpu"))
    uly = [r for r in rows if r["impl"] == "diffusers ulysses"]
    assert [r["world_size"] for r in uly] == [2, 4]
    spec = MODELS["flux"]
    attn_calls = sum(spec.configs["tiny"][k] for k in spec.layer_keys)
    for r in uly:
        assert "skipped" not in r, r
        assert r["mode"] == "ulysses" and r["output_shape_ok"] and r["outputs_finite"]
        assert math.isfinite(r["bound_speedup"]) and r["bound_speedup"] > 0 and r["rank0_ms"] > 0
        assert r["fills"] >= 4 * attn_calls
    for r in rows:
        if r["impl"] == "diffusers ring":
            assert "skipped" not in r or r["skipped"], r


def test_config_layouts():
    cfg = bound_diffusers.config("ulysses", 4, 30, None)
    assert cfg.ulysses_degree == 4 and cfg.ulysses_anything  # 30 heads: diffusers needs its 'anything' variant
    assert not bound_diffusers.config("ulysses", 2, 30, None).ulysses_anything
    assert bound_diffusers.config("ring", 4, 30, None).ring_degree == 4
    with pytest.raises(ValueError, match="one of"):
        bound_diffusers.config("tree", 2, 4, None)


def test_compiled_diffusers_side_retried_with_graph_breaks(monkeypatch):
    """A compile mode where Dynamo refuses diffusers' CP whole (fullgraph=True): the side is built again and compiled
    with graph breaks, its row says so (fullgraph False, the first error kept); its fake writes come from an eager
    call before compiling (compiled, the traced collectives record nothing). compile_model is stubbed (no Inductor on
    CPU): it raises for a diffusers-CP model under fullgraph=True and returns the others as they are."""
    from cp_ops.cli import run

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    calls = []

    def fake_compile_model(model, spec, args, overlap, kw_in=None):
        full = getattr(args, "fullgraph", True)
        calls.append((getattr(model, "_parallel_config", None) is not None, full))
        if getattr(model, "_parallel_config", None) is not None and full:
            raise RuntimeError("Unsupported HOP: Unsafe side effect (stub)")
        return model, 0

    monkeypatch.setattr(run, "compile_model", fake_compile_model)
    rows = bound.run_bound(_args("flux", compare="diffusers", bound=[2], bound_compile=["regional"]),
                           torch.device("cpu"))
    uly = next(r for r in rows if r["impl"] == "diffusers ulysses")
    assert uly["compile"] == "regional" and uly["fullgraph"] is False
    assert "Unsafe side effect (stub)" in uly["fullgraph_error"] and uly["fills"] > 0 and uly["outputs_finite"]
    assert (True, True) in calls and (True, False) in calls
    cp = next(r for r in rows if r["impl"] == "cp_ops")
    assert "fullgraph" not in cp and math.isfinite(cp["bound_speedup"])


def test_rows_with_no_time_left_after_the_fills_are_invalid_not_a_number(capsys):
    """A side whose fill copies, timed alone, take at least its whole forward (rank 0 - fill <= 0: noise on a tiny
    model, or copies the forward overlapped) has no bound: its row is marked invalid with both times and the table
    says so (was: ZeroDivisionError at equal times, a negative bound printed as a number otherwise); a diffusers row
    marked invalid (non-finite output) says 'invalid' in the table too, not only in the JSON (and in
    benchmarks/bound_table.py's markdown table, which also names the impl: diffusers' rows read as cp_ops')."""
    spec = MODELS["flux"]
    out = torch.randn(1, 8, 4)
    sides = [bound_sides.Side("diffusers", "diffusers", 1, samples=[10.0], out=out),
             bound_sides.Side("cp_ops W2", "cp", 2, mode="ulysses", samples=[4.0], fill_ms=4.0, out=out),
             bound_sides.Side("diffusers ulysses W2", "dcp", 2, mode="ulysses", label="ulysses", samples=[6.0], fill_ms=0.5,
                        out=torch.full_like(out, float("nan"))),
             bound_sides.Side("cp_ops W4", "cp", 4, mode="ulysses", samples=[3.0], fill_ms=3.5, out=out)]
    args = _args("flux", bound=[2, 4])
    rows = bound_report._rows(sides, args, spec, spec.config("tiny", None), "tiny", [1], 64, "eager", False)
    by = {(r["world_size"], r["impl"]): r for r in rows}
    for key, raw, fill in (((2, "cp_ops"), 4.0, 4.0), ((4, "cp_ops"), 3.0, 3.5)):
        r = by[key]
        assert r["bound_speedup"] is None and "fill" in r["invalid"] and f"{raw}" in r["invalid"], r
        assert f"{fill}" in r["invalid"], r
    assert math.isfinite(by[(2, "diffusers ulysses")]["bound_speedup"]) and by[(2, "diffusers ulysses")]["invalid"]
    bound_report.print_table(rows, dict(cls=spec.cls, config="tiny", tokens=64, chunks=1))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("eager ")]
    assert len(lines) == 3 and all("invalid" in ln for ln in lines), lines
    from cp_ops.cli.bound_report import results_table as table  # the results' markdown table: the impl named
    md = [ln for ln in table(rows).splitlines()[2:]]
    assert len(md) == 3 and all("invalid" in ln for ln in md) and "diffusers ulysses (ulysses)" in md[1], md
