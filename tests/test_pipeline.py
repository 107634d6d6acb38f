"""parallelize_pipeline on tiny diffusers pipelines (a Wan 2.2-style pipeline with two expert transformers, Flux) on
2 gloo ranks equals the unparallelized pipeline; the example cp_ops/examples/generate.py runs under torchrun and
writes its output on rank 0 only."""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
NEEDS = [m for m in ("transformers",) if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(NEEDS), reason=f"diffusers pipelines need {NEEDS} (pip install transformers): "
                                                     "diffusers' pipeline classes are placeholders without it")

from dist_util import run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _output(pipe, call):
    with torch.no_grad():
        out = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
    return out.frames if hasattr(out, "frames") else out.images


def _pipelines_equal(rank, w):
    from cp_ops.examples.tiny import tiny_flux, tiny_wan22
    from cp_ops.integrations.diffusers import parallelize_pipeline

    for build, names, mode in [(tiny_wan22, ("transformer", "transformer_2"), "agkv"),
                               (tiny_flux, ("transformer",), "ulysses")]:
        ref_pipe, call = build()
        ref_pipe.set_progress_bar_config(disable=True)
        ref = _output(ref_pipe, call)
        pipe, call = build()
        calls = {n: 0 for n in names}
        for n in names:
            getattr(pipe, n).register_forward_pre_hook(lambda *a, n=n: calls.__setitem__(n, calls[n] + 1))
        assert parallelize_pipeline(pipe, mode=mode, transport="torch", chunks=1) is pipe
        assert pipe.cp_ops_transformers == names and pipe.cp_ops_writes_output == (rank == 0)
        # the planned layout: Wan runs CFG (one call per branch) -> 2 lanes x CP1; Flux-dev has none -> CP over all
        lanes = 2 if build is tiny_wan22 else 1
        assert pipe.cp_ops_layout.layout.lanes == lanes, str(pipe.cp_ops_layout)
        for n in names:  # the options reached every transformer
            st = getattr(pipe, n)._cp_ops_state
            assert (st.mode, st.transport, st.chunks, st.world) == (mode, "torch", 1, w // lanes), (n, vars(st))
        out = _output(pipe, call)
        assert all(c > 0 for c in calls.values()), calls  # both experts ran (Wan 2.2: one step each)
        assert out.shape == ref.shape and out.std() > 0, (out.shape, ref.shape)
        if build is tiny_wan22:  # one token stream, even shards: the same kernels see the same data
            assert np.array_equal(out, ref), np.abs(out - ref).max()
        else:  # joint attention: its keys in another order, equal to rounding (through 2 steps and the VAE)
            assert np.abs(out - ref).max() <= 1e-5, np.abs(out - ref).max()
    # the options are passed on as they are: an unknown one is parallelize's error
    pipe, _ = tiny_flux()
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        parallelize_pipeline(pipe, transport="torch", bogus=1)


def test_parallelize_pipeline_equals_unparallelized():
    run_ranks(_pipelines_equal, 2)


def _pipeline_comm_dtype(rank, w):
    """parallelize_pipeline(comm_dtype=) and `cp-ops generate --comm-dtype` (its parallelize step) reach the
    transformer (they did not take it): FP8 on the link, near the unparallelized pipeline's output but not equal."""
    import argparse

    from cp_ops.cli.generate import parallelize_transformers
    from cp_ops.examples.tiny import tiny_flux
    from cp_ops.integrations.diffusers import parallelize_pipeline

    ref_pipe, call = tiny_flux(steps=1)
    ref_pipe.set_progress_bar_config(disable=True)
    ref = _output(ref_pipe, call)
    pipe, call = tiny_flux(steps=1)
    parallelize_pipeline(pipe, mode="ulysses", transport="torch", chunks=1, comm_dtype="e4m3")
    assert pipe.transformer._cp_ops_state.comm_dtype == ("e4m3",) * 4
    out = _output(pipe, call)
    err = np.abs(out - ref).max()
    assert 0 < err <= 1e-2, err  # FP8 e4m3 on Q, K, V, O: not bitwise (2.6e-4 measured), within its error
    # the CLI's parallelize step: the same state as parallelize_pipeline's (so the same calls)
    cli, _ = tiny_flux(steps=1)
    parallelize_transformers(cli, argparse.Namespace(mode="ulysses", transport="torch", comm_dtype="e4m3"))
    st, want = cli.transformer._cp_ops_state, pipe.transformer._cp_ops_state
    assert (st.comm_dtype, st.mode, st.transport) == (want.comm_dtype, want.mode, want.transport), vars(st)


def test_parallelize_pipeline_and_generate_take_comm_dtype():
    run_ranks(_pipeline_comm_dtype, 2)


def test_generate_parses_and_checks_comm_dtype():
    from cp_ops.cli._args import UsageError
    from cp_ops.cli.generate_args import check
    from cp_ops.cli.main import build_parser

    base = ["generate", "--checkpoint", ROOT, "--prompt", "p"]
    assert build_parser().parse_args(base).comm_dtype == "none"
    args = build_parser().parse_args(base + ["--comm-dtype", "e4m3:qvo"])
    assert args.comm_dtype == "e4m3:qvo"
    args.comm_dtype = "e4m3:x"
    with pytest.raises(UsageError, match=r"generate: --comm-dtype takes none, e4m3, e5m2 or FMT:LETTERS.*'e4m3:x'"):
        check(args, "cpu", 2)


def test_parallelize_pipeline_errors():
    from cp_ops.integrations.diffusers import parallelize_pipeline

    class NoTransformer:
        components = {"vae": torch.nn.Linear(2, 2), "scheduler": object()}

    with pytest.raises(ValueError, match=r"NoTransformer has no transformer cp_ops supports: components \{'vae': "
                                         r"'Linear', 'scheduler': 'object'\}"):
        parallelize_pipeline(NoTransformer())
    with pytest.raises(ValueError, match="takes a diffusers pipeline"):
        parallelize_pipeline(torch.nn.Linear(2, 2))
    os.environ["LOCAL_RANK"], saved = "x", os.environ.get("LOCAL_RANK")
    try:
        from cp_ops.integrations.diffusers.pipeline import local_device

        with pytest.raises(ValueError, match="LOCAL_RANK must be an integer .* got 'x'"):
            local_device()
    finally:
        os.environ.pop("LOCAL_RANK") if saved is None else os.environ.__setitem__("LOCAL_RANK", saved)


def test_example_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m cp_ops.examples.generate` (no checkpoint: the tiny pipeline) writes one GIF,
    from rank 0, nothing else, equal to the unparallelized pipeline's."""
    from diffusers.utils import export_to_gif

    from cp_ops.examples.tiny import tiny_wan22

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = subprocess.run([torchrun, "--nproc-per-node", "2", "-m", "cp_ops.examples.generate", "--out", "fox.gif"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("wrote fox.gif (2 transformers under CP)") == 1, p.stdout
    assert p.stdout.count("no --checkpoint: a tiny random Wan 2.2-style pipeline") == 1, p.stdout  # by rank 0 alone
    assert "--prompt/--steps" not in p.stdout, p.stdout  # named only where the user gave them
    assert sorted(os.listdir(tmp_path)) == ["fox.gif"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun rank: CPU kernels round alike
    try:
        pipe, call = tiny_wan22()
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            frames = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="pil").frames[0]
    finally:
        torch.set_num_threads(threads)
    export_to_gif(frames, str(tmp_path / "ref.gif"))
    assert (tmp_path / "fox.gif").read_bytes() == (tmp_path / "ref.gif").read_bytes()


@pytest.mark.parametrize("new", [True, False])
def test_example_loads_a_checkpoint_in_bf16_on_any_diffusers(monkeypatch, tmp_path, new):
    """`cp_ops.examples.generate --checkpoint X` asks from_pretrained for bf16 with the keyword the installed diffusers
    reads: `dtype=` where it has it, `torch_dtype=` on older diffusers (up to 0.37 at least: they ignore `dtype=`
    with a logged line and load fp32, twice the memory of a 14B expert pair)."""
    import runpy

    import diffusers
    import diffusers.utils.deprecation_utils as dep

    if not new:
        monkeypatch.delattr(dep, "_resolve_dtype", raising=False)
    elif not hasattr(dep, "_resolve_dtype"):
        pytest.skip("this diffusers has no dtype= keyword")
    seen = {}

    class Loaded(Exception):
        pass

    def from_pretrained(path, **kw):
        seen.update(kw, path=path)
        raise Loaded

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", from_pretrained)
    monkeypatch.setattr(sys, "argv", ["generate", "--checkpoint", str(tmp_path)])
    monkeypatch.delitem(sys.modules, "cp_ops.examples.generate", raising=False)
    with pytest.raises(Loaded):
        runpy.run_module("cp_ops.examples.generate", run_name="__main__")
    key = "dtype" if new else "torch_dtype"
    assert seen == {"path": str(tmp_path), key: torch.bfloat16}, seen
