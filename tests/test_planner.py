"""The planned layout (cp_ops/integrations/diffusers/planner.py): CFG lanes x CP width from the measured bound table
and the link model. CPU checks of the table's decisions (no model runs), and one rank launch at W = 4 in which
``parallelize_pipeline(pipe)`` with no layout arguments runs a true-CFG tiny Qwen-Image pipeline on 2 lanes, equal to
the unparallelized pipeline."""

import importlib.util

import numpy as np
import pytest

from cp_ops.integrations.diffusers import planner

QWEN, FLUX, WAN = "QwenImageTransformer2DModel", "FluxTransformer2DModel", "WanTransformer3DModel"


def test_qwenimage_at_8_picks_two_lanes_of_cp4():
    """The bound: 2 x rank0(W8) = 103.8 ms per step vs rank0(W4) = 79.7 ms with lanes (regional+capture)."""
    p = planner.plan(QWEN, 8, cfg="paired", path="regional+capture")
    assert (p.layout.lanes, p.layout.cp, p.layout.mode, p.cfg_parallel) == (2, 4, "ulysses", True), p
    lanes, cp8 = p.layouts
    assert (cp8.lanes, cp8.cp, cp8.forwards) == (1, 8, 2)
    assert (lanes.forward_ms, cp8.forward_ms) == (79.7, 51.9)  # the measured resolution: the table's numbers
    assert 2 * cp8.forward_ms == pytest.approx(103.8) and cp8.comm_ms > 0 and lanes.comm_ms > 0
    assert cp8.step_ms / lanes.step_ms > 1.25, p
    assert "2 lanes x CP4 predicted" in p.why and "vs CP8" in p.why
    text = str(p)
    assert "<- chosen" in text and "Qwen-Image 1328²" in text and "regional+capture" in text
    # the default CUDA path (the whole forward captured, no compile) and the CPU's eager: lanes too
    for path in ("eager+graphs", "eager"):
        assert planner.plan(QWEN, 8, cfg="paired", path=path).layout.lanes == 2, path


def test_flux_without_true_cfg_takes_all_ranks():
    for n in (2, 4, 8):
        p = planner.plan(FLUX, n, cfg=None, config={"num_layers": 19})
        assert (p.layout.lanes, p.layout.cp, p.layout.forwards) == (1, n, 1), p
        assert "no classifier-free guidance" in p.why and len(p.layouts) == 1


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="needs diffusers")
def test_cfg_kind_from_the_pipelines_defaults():
    import diffusers

    want = {"WanPipeline": "paired", "QwenImagePipeline": "paired", "FluxPipeline": None,
            "HunyuanVideoPipeline": None, "LTXPipeline": "batched", "ZImagePipeline": "batched",
            "StableDiffusion3Pipeline": None}
    from cp_ops.integrations.diffusers.lanes import cfg_kind

    got = {n: cfg_kind(getattr(diffusers, n)) for n in want}
    assert got == want


def test_lanes_only_where_they_win(monkeypatch):
    """A batched-CFG model whose measured forward scales better than linearly from 4 to 8 ranks: one lane of CP8
    (2 forwards) beats 2 lanes of CP4; the same model with the measured LTX numbers takes lanes."""
    ltx = planner.BOUND["LTXVideoTransformer3DModel"][0]
    assert planner.plan("LTXVideoTransformer3DModel", 8, cfg="batched").layout.lanes == 2
    fast8 = planner.Row("superlinear", {}, ltx.tokens, ltx.heads, ltx.head_dim, ltx.calls,
                        {"eager+graphs": (86.5, 42.2, 23.4, 8.0)})
    monkeypatch.setitem(planner.BOUND, "LTXVideoTransformer3DModel", (fast8,))
    p = planner.plan("LTXVideoTransformer3DModel", 8, cfg="batched")
    assert (p.layout.lanes, p.layout.cp) == (1, 8), p
    assert p.layouts[1].lanes == 2 and p.layouts[1].step_ms > p.layout.step_ms


def test_tokens_scale_the_measured_forward():
    row = planner.BOUND[QWEN][0]
    at = {s: planner.plan(QWEN, 4, cfg=None, tokens=s).layout.forward_ms for s in (row.tokens, 2 * row.tokens)}
    assert at[row.tokens] == 99.8  # eager+graphs, W = 4
    assert 2 * at[row.tokens] < at[2 * row.tokens] < 4 * at[row.tokens]  # linear GEMMs, quadratic attention
    assert "at 13778 tokens" in str(planner.plan(QWEN, 8, cfg="paired", tokens=13778))


def test_config_picks_the_row_and_unmeasured_widths():
    wan14 = planner.plan(WAN, 8, cfg="paired", config={"num_layers": 40, "num_attention_heads": 40})
    assert wan14.row == "Wan2.1-14B 480p" and "stands in" not in wan14.why
    tiny = planner.plan(WAN, 8, cfg="paired", config={"num_layers": 2, "num_attention_heads": 4})
    assert tiny.row == "Wan2.1-1.3B 480p" and "Wan2.1-1.3B 480p's scaling stands in" in tiny.why
    # W = 16 is not measured: the widest measured width (8) scaled by 8 / 16
    p16 = planner.plan(FLUX, 16, cfg=None, config={"num_layers": 19})
    assert p16.layout.forward_ms == pytest.approx(30.7 / 2)


def test_no_row_takes_the_rule_without_numbers():
    p = planner.plan("SD3Transformer2DModel", 4, cfg="paired")
    assert p.cfg_parallel and p.layout.step_ms is None
    assert p.why.startswith("SD3Transformer2DModel has no measured row: the rule without numbers: the pipeline runs "
                            "CFG and N is even -> 2 lanes")
    assert not planner.plan("SD3Transformer2DModel", 3, cfg="paired").cfg_parallel
    assert not planner.plan("SD3Transformer2DModel", 4, cfg=None).cfg_parallel
    assert "planned layout: 2 lanes x CP2" in str(p)


def test_given_arguments_win():
    p = planner.plan(QWEN, 8, cfg="paired", lanes=1)
    assert not p.cfg_parallel and p.why.startswith("cfg_parallel=False given; the plan's 2 lanes x CP4 predicted")
    # an explicit mode is the lanes' mode; a width it cannot split is not a candidate
    p = planner.plan(QWEN, 8, cfg="paired", mode="agkv")
    assert {lay.mode for lay in p.layouts} == {"agkv"}
    p = planner.plan(QWEN, 8, cfg="paired", mode="ulysses", config={"num_attention_heads": 4})
    assert [(lay.lanes, lay.cp) for lay in p.layouts] == [(2, 4)]
    with pytest.raises(ValueError, match="cfg one of None/'paired'/'batched'"):
        planner.plan(QWEN, 8, cfg="yes")


def test_path_for_parallelize_arguments():
    assert planner.path_for(False, "auto", cuda=True) == "eager+graphs"
    assert planner.path_for(True, "auto", cuda=True) == "regional+capture"
    assert planner.path_for(False, False, cuda=True) == "eager"
    assert planner.path_for(True, "auto", cuda=False) == "eager"


def test_across_nodes_a_lane_is_priced_as_the_split():
    p = planner.plan(QWEN, 16, cfg="paired", ranks_per_node=8)
    lanes, cp16 = p.layouts
    assert (lanes.lanes, lanes.cp, lanes.mode) == (2, 8, "ulysses"), str(p)  # each lane on one node
    assert cp16.mode.startswith("split ") and cp16.comm_ms > lanes.comm_ms, str(p)  # the network in the way


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs diffusers and transformers")
def test_cli_plan_prints_the_choice(capsys):
    pytest.importorskip("diffusers")
    from cp_ops.cli.main import main

    assert main(["plan", "qwenimage", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "(6889 tokens), QwenImagePipeline (CFG: paired), 8 GPUs" in out  # the GPU resolution, on any device
    assert "planned layout: 2 lanes x CP4 (ulysses)" in out and "CP8" in out and "<- chosen" in out
    assert "one GPU: " in out and "ms per step" in out
    assert main(["plan", "flux", "--gpus", "4", "--compile"]) == 0
    out = capsys.readouterr().out
    assert "planned layout: CP4 (ulysses)" in out and "regional+capture" in out
    assert main(["plan", "flux", "--gpus", "0"]) == 2
    assert "cp-ops: plan flux: --gpus takes the GPU count N >= 1; got 0" in capsys.readouterr().err


def test_the_docs_table_is_the_planners():
    """docs/pipelines.md's table of planned layouts per model at N = 2/4/8 is what the planner predicts."""
    import os
    import re

    from cp_ops.cli.models import MODELS

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "pipelines.md"), encoding="utf-8").read()
    kinds = {"none": None, "one call per branch": "paired", "batched": "batched"}
    spec_of = {"FLUX": "flux", "Qwen": "qwenimage", "Z-Image": "zimage", "LTX": "ltx", "Wan2.1-1.3B": "wan",
               "HunyuanVideo": "hunyuanvideo"}
    rows = re.findall(r"^\| (\S+) [^|]*\(([^)]*)\) \| ([\d.]+) \| (.*) \|$", doc, re.M)
    assert len(rows) == 6, rows
    for name, kind, one, cells in rows:
        spec = MODELS[next(v for k, v in spec_of.items() if name.startswith(k))]
        cfg = spec.config(spec.gpu_config)
        assert f"{planner.plan(spec.cls, 1, cfg=kinds[kind], config=cfg).layout.step_ms:.1f}" == one, name
        for n, cell in zip((2, 4, 8), cells.split(" | ")):
            p = planner.plan(spec.cls, n, cfg=kinds[kind], config=cfg)
            lay = p.layout
            want = f"{'2 × ' if lay.lanes == 2 else ''}CP{lay.cp} {lay.step_ms:.1f}"
            assert cell.replace("2 lanes × ", "2 × ").startswith(want), (name, n, cell, str(p))


# ---- one rank launch: parallelize_pipeline(pipe) with no layout arguments ----

def _planned_lanes(rank, w):
    from test_cfg_pipelines import _count_forwards, _output, tiny_qwenimage

    from cp_ops.integrations.diffusers import parallelize_pipeline

    ref_pipe, call = tiny_qwenimage()
    ref_pipe.set_progress_bar_config(disable=True)
    ref = _output(ref_pipe, call)
    pipe, call = tiny_qwenimage()
    parallelize_pipeline(pipe, transport="torch", chunks=1)
    lay = pipe.cp_ops_layout
    assert (lay.layout.lanes, lay.layout.cp, lay.cfg_parallel) == (2, 2, True), str(lay)
    assert "Qwen-Image 1328²'s scaling stands in" in lay.why  # the tiny config has no row of its own
    calls = _count_forwards(pipe, ("transformer",))
    out = _output(pipe, call)
    assert calls == {"transformer": 2}, calls  # one forward per step on each lane: its branch's only
    assert out.shape == ref.shape and out.std() > 0
    assert np.abs(out - ref).max() <= 1e-5, np.abs(out - ref).max()  # joint attention over CP2: to rounding


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None or importlib.util.find_spec("transformers") is None,
                    reason="diffusers pipelines need diffusers and transformers")
def test_parallelize_pipeline_plans_lanes_for_true_cfg():
    from dist_util import run_ranks

    run_ranks(_planned_lanes, 4)


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="needs diffusers")
def test_a_guidance_distilled_pipeline_gets_no_lanes():
    """Flux 2 Klein's distilled checkpoints (``is_distilled`` in the pipeline's config) run no CFG at the default
    ``guidance_scale`` 4: two lanes would pair no forward (each runs over all ranks, as without lanes)."""
    import diffusers
    import torch
    from diffusers.configuration_utils import FrozenDict

    from cp_ops.integrations.diffusers.lanes import cfg_kind

    cls = diffusers.Flux2KleinPipeline
    pipe = object.__new__(cls)
    pipe._internal_dict = FrozenDict(is_distilled=True)
    model = type("Flux2Transformer2DModel", (torch.nn.Module,), {})()
    p = planner.plan_pipeline(pipe, model, 4, ranks_per_node=None, cuda=True)
    assert not p.cfg_parallel and (p.layout.lanes, p.layout.cp) == (1, 4), str(p)
    pipe._internal_dict = FrozenDict(is_distilled=False)
    assert planner.plan_pipeline(pipe, model, 4, ranks_per_node=None, cuda=True).cfg_parallel
    assert cfg_kind(cls) == "paired" and cfg_kind(cls, {"is_distilled": False}) == "paired"
    assert cfg_kind(cls, {"is_distilled": True}) is None


def test_two_lanes_given_on_odd_n_says_it_cannot_run():
    """cfg_parallel=True on 3 ranks: the plan says it cannot run (it printed '2 lanes x CP1' for a row-less class, and
    a CP3 prediction under 'cfg_parallel=True given' for a measured one); parallelize raises."""
    for cls in (QWEN, "SD3Transformer2DModel"):
        p = planner.plan(cls, 3, cfg="paired", lanes=2)
        assert (p.layout.lanes, p.layout.cp) == (1, 3) and p.layout.step_ms is None, str(p)
        assert p.why.startswith("cfg_parallel=True given, which N=3 cannot run: two equal lanes need an even N"), p.why
    assert planner.plan(QWEN, 3, cfg="paired", lanes=1).layout.cp == 3
