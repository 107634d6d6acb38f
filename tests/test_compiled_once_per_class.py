"""Regional compilation of a parallelized model compiles each block class once (cp_ops.integrations.diffusers.compiled's
promise, as diffusers' compile_repeated_blocks): no per-block recompile. A per-module constant in the traced call (the
attention's layer tag was one) made every block compile its own graph — 57 compiles per side for FLUX.1-dev, and past
Dynamo's recompile limit (8) the remaining blocks ran eager. Checked with a recompile limit of 1 that raises."""

import pytest
import torch
import torch.distributed as dist

from cp_ops.cli.models import MODELS, build
from cp_ops.integrations.diffusers import parallelize
from cp_ops.integrations.diffusers.compiled import compile_blocks


@pytest.fixture
def fake2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_ops.cli import bound_fill

    with bound_fill.filled():  # outputs written (torch 2.11's fake all-to-all leaves them)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["agkv", "ulysses"])
def test_regional_compile_once_per_block_class(fake2, mode):
    import torch._dynamo

    torch._dynamo.reset()
    spec = MODELS["flux"]
    model, cfg = build(spec, "tiny", 3, "cpu", torch.float32)  # 3 double- and 3 single-stream blocks
    f, h, w = spec.cpu_latent
    kw = spec.make_inputs(cfg, 16, 1, f, h, w, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(0))
    parallelize(model, fake2, mode=mode, transport="torch")
    assert compile_blocks(model, overlap=False) == 6
    key = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{key: 1, "fail_on_recompile_limit_hit": True}), torch.no_grad():
        out = spec.predict(model, kw)  # raises FailOnRecompileLimitHit when a second block of a class recompiles
    assert torch.isfinite(out).all()
    torch._dynamo.reset()


def test_whole_model_compile_once_over_calls(fake2):
    """A whole-model compile of a parallelized model compiles once for repeated calls at one resolution: the stream
    totals the splits record are forgotten at each forward's start and end, so every call enters with the same
    state (torch 2.11's Dynamo guarded on the totals found at entry: 0 at the first call, the previous call's
    counts at the second, so every parallelized model compiled twice; FLUX.1-dev ~100 s each on the H200)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    spec = MODELS["flux"]
    model, cfg = build(spec, "tiny", 1, "cpu", torch.float32)
    f, h, w = spec.cpu_latent
    kw = spec.make_inputs(cfg, 16, 1, f, h, w, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(0))
    parallelize(model, fake2, mode="agkv", transport="torch")
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True, dynamic=False)
    key = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch(**{key: 1, "fail_on_recompile_limit_hit": True}), torch.no_grad():
        outs = [spec.predict(compiled, kw) for _ in range(3)]  # a recompile raises FailOnRecompileLimitHit
    assert cnt.frame_count == 1, cnt.frame_count
    assert set(model._cp_ops_state.totals.values()) == {0}  # forgotten after the forward
    assert all(torch.equal(o, outs[0]) for o in outs[1:]) and torch.isfinite(outs[0]).all()
    torch._dynamo.reset()
