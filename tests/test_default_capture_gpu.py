"""parallelize's default (``cuda_graphs="auto"``) on a GPU (marked gpu; skipped without CUDA): the whole forward
captured in one CUDA graph where it can be, with the eager forward's numbers, bitwise; where it cannot, eager with
one warning and the same numbers.

* a real NCCL group of one rank: tiny Wan, Flux and Qwen-Image (a text mask) captured, equal to
  ``cuda_graphs=False`` bitwise over two inputs (the second a replay); a tiny Wan 2.2 pipeline through
  ``parallelize_pipeline`` (both experts captured, cond and uncond calls) equal to its eager run;
* a fake group of 2 ranks whose collectives write their outputs (one process: the zero-communication bound's setting):
  captured and equal to eager bitwise;
* 2 ranks sharing the GPU: the torch transport (gloo moves the CUDA tensors through host memory) runs eager with the
  warning; the fast transport captures, or falls back with the warning — equal to eager bitwise either way; a Wan
  2.2 pipeline with CFG lanes (2 lanes x CP1) equal to its eager run.
"""

import copy
import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from dist_util import run_ranks  # noqa: E402

ACTIVATIONS = ("hidden_states", "encoder_hidden_states", "pooled_projections")


def _on(kw: dict, dev) -> dict:
    return {k: (v.to(dev, torch.bfloat16) if k in ACTIVATIONS else v.to(dev)) if isinstance(v, torch.Tensor) else v
            for k, v in kw.items()}


def _default_equals_eager(name, dev, group=None, transport="torch", b=1, size=(2, 8, 8), mask=False,
                          captures=True) -> None:
    """The default parallelize and ``cuda_graphs=False`` on two inputs: bitwise equal; ``captures``: True = the
    default captured (no warning), False = it ran eager with one warning, None = either (a warning iff eager)."""
    from cp_ops import captured
    from cp_ops.integrations.diffusers import parallelize
    from diffusers_tiny import build, inputs, sample

    base = build(name).to(dev, torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    kws = [_on(inputs(name, b, size, 8, g, mask=mask), dev) for _ in range(2)]
    eager = parallelize(copy.deepcopy(base), group, mode="agkv", transport=transport, chunks=1, cuda_graphs=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        default = parallelize(copy.deepcopy(base), group, mode="agkv", transport=transport, chunks=1)
        with torch.no_grad():
            outs = [sample(default(**kw)) for kw in kws]
    with torch.no_grad():
        refs = [sample(eager(**kw)) for kw in kws]
    torch.cuda.synchronize()
    cf = captured.captured(default)
    ran_captured = cf is not None and cf.eager_why is None
    told = [str(w.message) for w in seen if "runs eager, its whole forward not captured" in str(w.message)]
    if captures is not None:
        assert ran_captured == captures, (name, told)
    assert len(told) == (0 if ran_captured else 1), (name, told)
    if ran_captured:
        assert cf.captures == 1, (name, cf.keys())
    for o, r in zip(outs, refs):
        assert torch.equal(o, r), (name, (o.float() - r.float()).abs().max().item())
    assert not torch.equal(outs[0], outs[1])


def _pipeline_equals_eager(dev, **kwargs) -> list:
    """A tiny Wan 2.2 pipeline (two experts, CFG) through parallelize_pipeline: the default's frames equal
    ``cuda_graphs=False``'s bitwise. Returns the default pipeline's experts' captures (None: not captured)."""
    import numpy as np

    from cp_ops import captured
    from cp_ops.examples.tiny import tiny_wan22
    from cp_ops.integrations.diffusers import parallelize_pipeline

    frames, graphed = [], None
    for graphs in ({}, {"cuda_graphs": False}):
        pipe, call = tiny_wan22()
        parallelize_pipeline(pipe, device=dev, mode="agkv", chunks=1, **kwargs, **graphs)
        call = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in call.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.no_grad():
                frames.append(pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np").frames)
        if graphed is None:
            graphed = [captured.captured(getattr(pipe, n)) for n in pipe.cp_ops_transformers]
    assert frames[0].std() > 0 and np.array_equal(frames[0], frames[1]), np.abs(frames[0] - frames[1]).max()
    return graphed


def _one_rank(rank, w):
    dev = torch.device("cuda", rank)
    for name in ("wan", "flux"):
        _default_equals_eager(name, dev)
    _default_equals_eager("qwenimage", dev, b=2, size=(1, 8, 8), mask=True)  # diffusers' pageable copy replaced
    experts = _pipeline_equals_eager(dev, transport="torch")
    # each expert ran one step: its cond call captured, its uncond call (the same shapes) replayed
    assert [(cf.captures, cf.eager_why) for cf in experts] == [(1, None)] * 2, [vars(cf) for cf in experts]


def test_default_captures_on_one_rank():
    run_ranks(_one_rank, 1, timeout=600, device="cuda")


def test_default_on_a_fake_group():
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (the 'fake' backend)

    from cp_ops.cli import bound_fill

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        with bound_fill.filled():
            group = dist.new_group([0, 1])
        _default_equals_eager("wan", torch.device("cuda", 0), group=group)
    finally:
        dist.destroy_process_group()


def _shared(rank, w, transport):
    dev = torch.device("cuda", 0)
    # torch: gloo moves CUDA tensors through host memory, which a graph cannot hold: eager, told at parallelize
    _default_equals_eager("wan", dev, transport=transport, captures=False if transport == "torch" else None)
    _pipeline_equals_eager(dev, transport=transport, cfg_parallel=True)


@pytest.mark.parametrize("transport", ["torch", "fast"])
def test_default_on_ranks_sharing_one_gpu(transport, monkeypatch):
    monkeypatch.setenv("CP_OPS_FAST_HEAP", "ipc")
    run_ranks(_shared, 2, transport, timeout=600, device="one_gpu")
