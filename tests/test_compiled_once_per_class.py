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
