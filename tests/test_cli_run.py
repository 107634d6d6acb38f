"""`cp-ops run MODEL`: the models' input builders, CP = single rank for every model (skipped, with the reason, for
a model cp_ops.parallelize does not support yet), --steps and --compare through the real rank body, regional
compilation compiles each block class once, the --profile breakdown's arithmetic, and argument errors."""

import argparse
import json
import os

import pytest
import torch

from dist_util import run_ranks

from cp_ops.cli.models import MODELS, build

OTHERS = ("zimage", "flux", "qwenimage", "hunyuanvideo", "ltx")


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_forward_inputs(name):
    """Each model's tiny config runs on its built inputs (batch 2, seeded, no zeros); item 0 of the batch gives the
    same output as that item alone (the builders' masks/ids/shapes are per item), and the output has the
    latents' shape."""
    spec = MODELS[name]
    model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    f, h, w = spec.cpu_latent
    kw2 = spec.make_inputs(cfg, spec.text_tokens["tiny"], 2, f, h, w, "cpu", torch.float32,
                           torch.Generator().manual_seed(1))
    with torch.no_grad():
        out2 = spec.predict(model, kw2)
        kw1 = {k: (v[:1] if isinstance(v, (torch.Tensor, list)) and k not in ("img_ids", "txt_ids") else v)
               for k, v in kw2.items()}
        out1 = spec.predict(model, kw1)
    assert out2.shape == spec.get_latents(kw2).shape and torch.isfinite(out2).all() and out2.abs().max() > 0
    torch.testing.assert_close(out1[0], out2[0], rtol=1e-5, atol=1e-5)
    pt, ph, pw = spec.patch(cfg)
    assert (ph, pw) == ((1, 1) if name == "ltx" else (2, 2))  # LTX-Video: patch 1 on its 32x-compressed latent
    assert spec.tokens(cfg, f, h, w) == (f // pt) * (h // ph) * (w // pw)


def _ns(**kw):
    base = dict(model="wan", config="tiny", checkpoint=None, layers=None, frames=2, height=16, width=16, text_tokens=16,
                batch=1, dtype="fp32", mode="auto", transport="torch", chunks=None, compile=None, no_overlap=False,
                cuda_graphs=False, steps=0, cfg=False, compare=None, profile=None, profile_runs=1, warmup=0,
                repeats=1, out=None, settings={})
    base.update(kw)
    return argparse.Namespace(**base)


def _ranks_body(rank, world_size, outdir):
    """One spawn for everything that needs ranks: the real `run` body (wan --steps 2 --compare diffusers), then every
    other model and wan --cfg: parallelized vs unparallelized on the same inputs, or the reason parallelize gave."""
    import torch.distributed as dist

    from cp_ops.cli.run import denoise, run_model
    from cp_ops.integrations.diffusers import parallelize

    import contextlib
    import io

    import cp_ops.cli.run as run_module

    run_module.available_cores = lambda: 1  # as on a 1-core machine: 2 ranks oversubscribe it, rank 0 warns
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        run_model(rank, world_size, torch.device("cpu"), _ns(steps=2, compare="diffusers",
                                                             profile=os.path.join(outdir, "prof"),
                                                             out=os.path.join(outdir, "wan_steps.json")))
        # --mode agkv --chunks 2: parallelize pipelines the model's attention; recorded in the JSON meta
        run_model(rank, world_size, torch.device("cpu"), _ns(mode="agkv", chunks=2,
                                                             out=os.path.join(outdir, "wan_chunks.json")))
        # --comm-dtype e4m3:qvo (K and V apart) with mode auto at W = 2
        run_model(rank, world_size, torch.device("cpu"), _ns(comm_dtype="e4m3:qvo",
                                                             out=os.path.join(outdir, "wan_fp8.json")))
    with open(os.path.join(outdir, f"run_stdout{rank}.txt"), "w") as fh:
        fh.write(stdout.getvalue())
    results = {}
    for name, cfg_parallel in [(m, False) for m in ("wan",) + OTHERS] + [("wan", True)]:
        spec = MODELS[name]
        model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
        f, h, w = spec.cpu_latent
        kw = spec.make_inputs(cfg, spec.text_tokens["tiny"], 2, f, h, w, "cpu", torch.float32,
                              torch.Generator().manual_seed(3))
        with torch.no_grad():
            ref = spec.predict(model, kw)
        ref_steps, _ = denoise(model, spec, kw, 2, torch.device("cpu"), _ns(cfg=cfg_parallel))
        try:
            parallelize(model, mode="auto", transport="torch", **({"cfg_parallel": True} if cfg_parallel else {}))
        except (ValueError, TypeError) as e:
            if "support" not in str(e) and "cfg_parallel" not in str(e):
                raise
            results[name + ("+cfg" if cfg_parallel else "")] = {"unsupported": str(e)}
            continue
        with torch.no_grad():
            out = spec.predict(model, kw)
        out_steps, _ = denoise(model, spec, kw, 2, torch.device("cpu"), _ns(cfg=cfg_parallel))
        err = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
        results[name + ("+cfg" if cfg_parallel else "")] = {"err": err(out, ref), "steps_err": err(out_steps, ref_steps)}
    dist.barrier()
    if rank == 0:
        with open(os.path.join(outdir, "models.json"), "w") as fh:
            json.dump(results, fh)


@pytest.fixture(scope="module")
def ranks_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    run_ranks(_ranks_body, 2, str(d))
    with open(d / "models.json") as f:
        models = json.load(f)
    with open(d / "wan_steps.json") as f:
        wan = json.load(f)
    wan["stdout"] = [(d / f"run_stdout{r}.txt").read_text() for r in (0, 1)]
    with open(d / "wan_chunks.json") as f:
        wan["chunks_run"] = json.load(f)
    with open(d / "wan_fp8.json") as f:
        wan["fp8_run"] = json.load(f)
    return models, wan


def test_run_comm_dtype_with_k_and_v_apart(ranks_results):
    """`run wan --comm-dtype e4m3:qvo` at W = 2 (mode auto): the model runs Ulysses, as cp_ops.attention's 'auto' does
    with K and V apart (was: the CLI resolved 'auto' to AGKV without the formats, and every attention call raised 'AGKV
    gathers K and V together'); FP8 within the documented tolerance."""
    _, wan = ranks_results
    run = wan["fp8_run"]
    assert run["meta"]["mode"] == "ulysses" and run["meta"]["comm_dtype"] == "e4m3:qvo", run["meta"]
    row = next(r for r in run["rows"] if r["name"].startswith("cp_ops"))
    assert row["name"] == "cp_ops ulysses" and 0 < row["max_rel_err"] <= 0.125, row


def test_run_body_steps_and_compare(ranks_results):
    """`run wan --steps 2 --compare diffusers` on 2 gloo ranks: per-step times of both sides, CP equal to one rank
    bitwise, diffusers' rows skipped on CPU with their reason; the JSON carries env and versions."""
    _, wan = ranks_results
    rows = {r["name"]: r for r in wan["rows"]}
    assert set(rows) == {"1 rank", "diffusers ulysses", "diffusers ring", "cp_ops agkv"}  # auto at W = 2: AGKV
    assert len(rows["1 rank"]["step_ms"]) == 2 and len(rows["cp_ops agkv"]["step_ms"]) == 2
    assert rows["cp_ops agkv"]["max_rel_err"] == 0.0 and rows["cp_ops agkv"]["total_ms"] > 0
    assert "needs an accelerator" in rows["diffusers ring"]["skipped"]
    assert wan["meta"]["steps"] == 2 and wan["meta"]["diffusers"] and wan["meta"]["torch"]
    # --profile on CPU: a real trace per rank, the breakdown over the host's ops, every block and replicated module
    prof = wan["profile"]
    assert prof["device"] == "cpu" and set(prof["per_layer"]) == {"blocks.0", "blocks.1"}
    assert os.path.getsize(prof["trace"]) > 1000 and prof["trace"].endswith("trace_rank0.json.gz")
    assert 0 < prof["forward"]["busy_ms"] <= prof["forward"]["span_ms"] and prof["forward"]["comm_ms"] > 0
    assert prof["layers"]["attention_ms"] > 0 and prof["forward"]["gather_ms"] > 0
    assert {"condition_embedder", "attn2.to_k", "attn2.to_v"} <= set(prof["replicated"])
    # more ranks than cores: rank 0 says so, as cp-ops bench does
    assert "cp-ops run: warning: 2 ranks x 1 thread(s) = 2 > 1 cores here" in wan["stdout"][0]
    assert "warning" not in wan["stdout"][1]


def test_run_chunks(ranks_results):
    """`run wan --mode agkv --chunks 2`: the CP model runs pipelined AGKV (fp32 ≤ 1e-5 vs one rank; not bitwise:
    the LSE merge), chunks recorded in the JSON meta and the header; the default run records chunks 'auto'."""
    _, wan = ranks_results
    run = wan["chunks_run"]
    assert run["meta"]["chunks"] == 2 and run["meta"]["mode"] == "agkv" and wan["meta"]["chunks"] == "auto"
    assert 0 < run["result"]["max_rel_err"] <= 1e-5, run["result"]
    assert "mode=agkv transport=torch chunks=2 compile=no" in wan["stdout"][0]
    # one forward per row: the final times come from interleaved rounds; the first, sequential ones are kept
    single, cp = run["rows"][0], run["rows"][-1]
    assert single["name"] == "1 rank" and single["ms"] > 0 and single["ms_sequential"] > 0
    assert cp["ms"] > 0 and cp["ms_sequential"] > 0 and cp["speedup"] == single["ms"] / cp["ms"]
    assert "in interleaved rounds (each: the 1-rank model on rank 0 alone" in wan["stdout"][0]
    assert "ms_sequential" not in {k for r in wan["rows"] for k in r}  # --steps: one loop per side, not interleaved


def test_run_chunks_argument():
    """--chunks parses auto/ints >= 1 (auto = None, the default) and rejects the rest with argparse's usage error;
    --help explains the values."""
    from cp_ops.cli.main import build_parser

    p = build_parser()
    assert p.parse_args(["run", "wan"]).chunks is None
    assert p.parse_args(["run", "wan", "--chunks", "auto"]).chunks is None
    assert p.parse_args(["run", "wan", "--chunks", "3"]).chunks == 3
    run_parser = next(a for a in p._subparsers._group_actions[0].choices.values() if a.prog.endswith(" run"))
    text = " ".join(run_parser.format_help().split())
    assert "1 = transport-then-attend (bitwise equal to one GPU); k >= 2 = pipelined in k stages" in text
    assert "auto (default) = the heuristic (2 for agkv on the fast transport, else 1; measured on the first eager call " \
           "only with CP_OPS_TUNE_MODES=1)" in text


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_run_chunks_rejects(bad):
    """--chunks other than auto or an int >= 1: argparse's usage error (exit code 2)."""
    from cp_ops.cli.main import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "wan", "--chunks", bad])
    assert e.value.code == 2


@pytest.mark.parametrize("name", ["wan"] + list(OTHERS) + ["wan+cfg"])
def test_model_cp_equals_single(ranks_results, name):
    """CP2 (or 2 CFG lanes) = the unparallelized model: one forward and a 2-step denoising loop (fp32, ≤ 1e-5
    relative; batch 2 with a padded text mask where the model takes one)."""
    res = ranks_results[0][name]
    if "unsupported" in res:
        pytest.skip(f"cp_ops.parallelize does not support {name} yet: {res['unsupported']}")
    assert res["err"] <= 1e-5 and res["steps_err"] <= 1e-5, res


def test_regional_compile_once_per_class(monkeypatch):
    """--compile regional compiles each block's forward through cp_ops.compile with fullgraph; the 2 Wan blocks
    share one Dynamo frame (equal backends: see test_pass_graph's test_equal_options_share_compiled_frame), also
    when a block's input is a narrowed view (the CP split of a batch-1 sequence: Dynamo guards strides even
    along size-1 dims, so block inputs get contiguous strides); --compile full wraps the model; --cuda-graphs
    adds mode='reduce-overhead'; --no-overlap turns the pass off; static shapes everywhere (dynamic=False)."""
    import cp_ops
    from torch._dynamo.testing import CompileCounter

    from cp_ops.cli.run import compile_model
    from cp_ops.integrations.diffusers.compiled import canonical, contiguous_strides, uncompile_blocks

    seen, counter = [], CompileCounter()

    def fake_compile(fn, **kw):
        seen.append(kw)
        return torch.compile(fn, backend=counter, fullgraph=kw["fullgraph"])

    monkeypatch.setattr(cp_ops, "compile", fake_compile)
    spec = MODELS["wan"]
    model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    kw = spec.make_inputs(cfg, 16, 1, 2, 16, 16, "cpu", torch.float32, torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = spec.predict(model, kw)
        torch._dynamo.reset()
        m, n = compile_model(model, spec, _ns(compile="regional"), overlap=True)
        out = spec.predict(m, kw)
        # the CP split's view: a batch-1 shard narrowed from a longer sequence (stride(0) of the long one)
        x = torch.randn(1, 2 * 64, cfg["num_attention_heads"] * cfg["attention_head_dim"], generator=torch.Generator().manual_seed(1))
        view = x[:, :64]
        assert canonical(view).stride() == (view.shape[1] * view.shape[2], view.shape[2], 1)
        assert canonical(view) is not view and torch.equal(canonical(view), view) and canonical(x) is x
        for shape in [(1, 8192, 1536), (2, 0, 3), (1, 1, 4), (3, 4, 5, 6), (), (5, 1, 1)]:
            assert contiguous_strides(shape) == torch.empty(shape).stride(), shape
    assert n == 2 and counter.frame_count == 1 and seen == [dict(fullgraph=True, overlap=True, dynamic=False)] * 2
    torch.testing.assert_close(out, ref)
    uncompile_blocks(model, spec.blocks)
    assert all("forward" not in b.__dict__ and not b._forward_pre_hooks for b in model.blocks)
    seen.clear()
    compile_model(model, spec, _ns(compile="full", cuda_graphs=True, no_overlap=True), overlap=True)
    assert seen == [dict(fullgraph=True, overlap=False, dynamic=False, mode="reduce-overhead")]
    torch._dynamo.reset()


def test_full_compile_after_one_eager_forward(monkeypatch):
    """--compile full with the inputs: one eager forward first, so a model that builds state at its first call
    traces whole (Z-Image's RoPE table, made inside ``with torch.device('cpu')``: Dynamo's "Unsupported context
    manager" without it, seen on the H200 in 2026-12-02f); the compiled forward equals eager."""
    import cp_ops
    from torch._dynamo.testing import CompileCounter

    from cp_ops.cli.run import compile_model

    counter = CompileCounter()
    monkeypatch.setattr(cp_ops, "compile", lambda fn, **kw: torch.compile(fn, backend=counter, fullgraph=True))
    spec = MODELS["zimage"]
    f, h, w = spec.cpu_latent

    def fresh():
        model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
        return model, spec.make_inputs(cfg, 16, 1, f, h, w, "cpu", torch.float32, torch.Generator().manual_seed(0))

    torch._dynamo.reset()
    model, kw = fresh()
    with torch.no_grad(), pytest.raises(Exception, match="context manager"):  # the model as diffusers builds it
        spec.predict(compile_model(model, spec, _ns(compile="full"), overlap=False)[0], kw)
    torch._dynamo.reset()
    model, kw = fresh()
    with torch.no_grad():
        m, _ = compile_model(model, spec, _ns(compile="full"), overlap=False, kw_in=kw)
        out = spec.predict(m, kw)
        ref = spec.predict(model, kw)
    assert counter.frame_count == 1 and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch._dynamo.reset()


def _trace(tmp_path):
    """A hand-made Chrome trace: two identical forwards 1 ms apart (the second's kernels start before the first's
    host range would end + slack), each one layer with a compute, an all-to-all (70 µs of it exposed) and an
    attention kernel, a stream sync inside the layer, and an all-gather after the layer."""
    X = lambda name, cat, ts, dur, **a: dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, pid=1,  # noqa: E731
                                               tid=(7 if cat in ("kernel",) else 1), args=a)
    ev = [X("cp-ops forward", "user_annotation", 0, 1000), X("cp-ops layer blocks.0", "user_annotation", 10, 400),
          X("aten::mm", "cpu_op", 20, 10), X("cudaLaunchKernel", "cuda_runtime", 25, 2, correlation=1),
          X("gemm", "kernel", 100, 50, correlation=1),
          X("cp_ops::ulysses_start", "cpu_op", 40, 10), X("cudaLaunchKernel", "cuda_runtime", 45, 2, correlation=2),
          X("ncclDevKernel_AllToAll", "kernel", 120, 100, correlation=2),
          X("aten::_scaled_dot_product_cudnn_attention", "cpu_op", 60, 10),
          X("cudaLaunchKernel", "cuda_runtime", 65, 2, correlation=3), X("sdpa_kernel", "kernel", 250, 50, correlation=3),
          X("cudaStreamSynchronize", "cuda_runtime", 300, 5, correlation=9),
          X("_c10d_functional::all_gather_into_tensor", "cpu_op", 500, 10),
          X("cudaLaunchKernel", "cuda_runtime", 505, 2, correlation=4),
          X("ncclDevKernel_AllGather", "kernel", 600, 40, correlation=4)]
    second = [dict(e, ts=e["ts"] + 1000, args={k: v + 100 for k, v in e["args"].items()}) for e in ev]
    ev += second
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"traceEvents": ev}))
    return p


def test_profile_breakdown_arithmetic(tmp_path):
    from cp_ops.cli.profile import breakdown

    bd = breakdown(str(_trace(tmp_path)))
    layer = bd["per_layer"]["blocks.0"]
    approx = lambda a, b: abs(a - b) < 1e-9  # noqa: E731
    # span 100..300 µs; busy = [100, 220] ∪ [250, 300] = 170 µs; comm 100 µs of which 70 µs not under the gemm
    assert approx(layer["span_ms"], 0.2) and approx(layer["busy_ms"], 0.17) and approx(layer["idle_ms"], 0.03)
    assert approx(layer["attention_ms"], 0.05) and approx(layer["comm_ms"], 0.1) and approx(layer["exposed_comm_ms"], 0.07)
    assert layer["host_syncs"] == 1 and bd["device"] == "cuda" and bd["forwards"] == 2
    f = bd["forward"]
    assert approx(f["span_ms"], 0.54) and approx(f["busy_ms"], 0.21) and approx(f["gather_ms"], 0.04)
    assert f["host_syncs"] == 1


def test_cuda_graphs_takes_only_forward(capsys):
    from cp_ops.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["run", "wan", "--device", "cpu", "--cuda-graphs", "blocks"])
    assert e.value.code == 2
    assert "argument --cuda-graphs: invalid choice: 'blocks'" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["run", "wan", "--device", "cpu", "--cuda-graphs"], "run wan: --cuda-graphs needs CUDA"),
    (["run", "wan", "--device", "cpu", "--compile", "--cuda-graphs", "forward"], "run wan: --cuda-graphs needs CUDA"),
    (["run", "flux", "--device", "cpu", "--frames", "2"], "run flux: FluxTransformer2DModel is an image model; --frames must be 1"),
    (["run", "qwenimage", "--device", "cpu", "--config", "1.3b"], "run qwenimage: --config takes 20b|tiny; got '1.3b'"),
    (["run", "wan", "--device", "cpu", "--cfg", "--nproc", "3"], "--cfg splits the ranks into 2 CFG lanes; the CP world size must be even, got 3"),
    (["generate", "--device", "cpu", "--checkpoint", "/nonexistent", "--prompt", "a cat"], "has no model_index.json"),
])
def test_run_bad_input(args, message, capsys):
    from cp_ops.cli.main import main

    assert main(args + ["--out", ""] if args[0] == "run" else args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cp-ops: ") and message in err[0], err
