"""parallelize(..., compile=True): the one-call compiled path (regional compilation of every repeated block through
cp_ops.compile) equals the eager parallelized model on 2 gloo ranks; which blocks it compiles; its errors."""

import copy

import pytest
import torch

from dist_util import run_ranks

from cp_ops.integrations.diffusers.compiled import (compile_blocks, not_compilable, repeated_blocks,
                                                    uncompile_blocks)


def _compiled_equals_eager(rank, world_size):
    import torch._dynamo

    from cp_ops.integrations.diffusers import parallelize
    from diffusers_tiny import build

    torch._dynamo.reset()
    model = build("wan")
    g = torch.Generator().manual_seed(5)  # the same inputs on every rank
    x, t, text = torch.randn(1, 4, 2, 8, 8, generator=g), torch.tensor([300]), torch.randn(1, 16, 16, generator=g)
    with torch.no_grad():
        ref = model(x, t, text).sample
        eager = parallelize(copy.deepcopy(model), mode="agkv", transport="torch", chunks=1)
        out_eager = eager(x, t, text).sample
        fast = parallelize(copy.deepcopy(model), mode="agkv", transport="torch", chunks=1, compile=True)
        assert all("forward" in b.__dict__ for b in fast.blocks)  # each block's forward compiled
        out = fast(x, t, text).sample
        out2 = fast(x + 1, t, text).sample  # a second call: the compiled blocks again, fresh values
        ref2 = model(x + 1, t, text).sample
    assert torch.equal(out_eager, ref)
    for o, r in ((out, ref), (out2, ref2)):
        err = ((o - r).abs().max() / r.abs().max()).item()
        assert 0 <= err <= 1e-4, err  # Inductor fuses the pointwise work: equal to rounding, not bitwise
    assert not torch.equal(out, out2)
    torch._dynamo.reset()


def test_parallelize_compile_equals_eager():
    run_ranks(_compiled_equals_eager, 2, timeout=480)


def test_repeated_blocks_follow_diffusers():
    """The classes named in the model's _repeated_blocks, wherever they sit (Z-Image: 2 layers + its refiners)."""
    from cp_ops.cli.models import MODELS, build

    z, _ = build(MODELS["zimage"], "tiny", None, "cpu", torch.float32)
    found = repeated_blocks(z)
    assert len(found) == len(z.layers) + len(z.noise_refiner) + len(z.context_refiner) == 4
    assert all(type(b).__name__ == "ZImageTransformerBlock" for b in found)
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert repeated_blocks(plain) == [] and "nothing to compile" in not_compilable(plain)


def test_compile_errors(monkeypatch):
    import cp_ops
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_ops.integrations.diffusers import parallelize
    from diffusers_tiny import build

    monkeypatch.setattr(cp_ops, "compile", lambda fn, **kw: fn)  # the plumbing only: no compiler here
    model = build("wan")
    assert compile_blocks(model) == 2
    with pytest.raises(ValueError, match="already compiled"):
        compile_blocks(model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="parallelize\\(compile=True\\): the blocks of this .* already compiled"):
            parallelize(model, compile=True)
        assert getattr(model, "_cp_ops_group", None) is None  # refused before any hook went in
        with pytest.raises(ValueError, match="cuda_graphs=True needs compile=True"):
            parallelize(build("wan"), cuda_graphs=True)
    finally:
        dist.destroy_process_group()
    uncompile_blocks(model)
    assert all("forward" not in b.__dict__ and not b._forward_pre_hooks for b in model.blocks)
