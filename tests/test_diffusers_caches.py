"""diffusers' step caches on a parallelized model (cp_ops.integrations.diffusers.caches): FirstBlockCache's skip
decision is the same on every rank even where the ranks' local metrics straddle the threshold, and equals the
one-device model's decision; SeaCache is refused."""

import copy

import pytest
import torch

from dist_util import run_ranks


def _head_hook(model):
    return model.blocks[0]._diffusers_hook.get_hook("fbc_leader_block_hook")


def _two_steps(model, x1, x2, t, text):
    """Two forwards in one cache context; returns (second output, the head hook's decision at the second)."""
    with torch.no_grad(), model.cache_context("cond"):
        model(x1, t, text)
        out = model(x2, t, text).sample
        return out, _head_hook(model).state_manager.get_state().should_compute


def _caches_agree(rank, world_size):
    import torch.distributed as dist
    from diffusers import FirstBlockCacheConfig
    from diffusers.hooks import first_block_cache as fbc

    from cp_ops.integrations.diffusers import parallelize
    from diffusers_tiny import build

    base = build("wan")
    g = torch.Generator().manual_seed(11)  # the same inputs on every rank
    x1, t, text = torch.randn(1, 4, 2, 8, 8, generator=g), torch.tensor([500]), torch.randn(1, 16, 16, generator=g)
    x2 = x1.clone()
    x2[:, :, 0] += 3 * torch.randn(1, 4, 8, 8, generator=g)  # frame 0 = rank 0's 16 of the 32 tokens changes a lot

    # 1. each rank's own metric at step 2 (diffusers' formula on this rank's tokens; threshold 0: every rank computes)
    local = []
    real = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(self, r):
        prev = self.state_manager.get_state().head_block_residual
        if prev is not None:
            local.append(((r - prev).abs().mean() / prev.abs().mean()).item())
        return real(self, r)

    unsynced = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1)
    fbc.apply_first_block_cache(unsynced, FirstBlockCacheConfig(threshold=0.0))  # diffusers' own: no cp_ops reduce
    fbc.FBCHeadBlockHook._should_compute_remaining_blocks = spy
    try:
        _two_steps(unsynced, x1, x2, t, text)
    finally:
        fbc.FBCHeadBlockHook._should_compute_remaining_blocks = real
    metrics = [None] * world_size
    dist.all_gather_object(metrics, local[0])
    lo, hi = min(metrics), max(metrics)
    assert hi > 1.5 * lo, metrics  # the ranks' local metrics differ ...
    threshold = (lo + hi) / 2  # ... and straddle this threshold: decided locally, rank 0 computes, rank 1 skips
    assert (metrics[0] > threshold) != (metrics[1] > threshold)

    # 2. cp_ops' reduced decision, enable_cache after parallelize, and the one-device model's
    cfg = FirstBlockCacheConfig(threshold=threshold)
    synced = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1)
    synced.enable_cache(cfg)
    out, decision = _two_steps(synced, x1, x2, t, text)
    one = copy.deepcopy(base)
    one.enable_cache(cfg)
    ref, ref_decision = _two_steps(one, x1, x2, t, text)
    decisions = [None] * world_size
    dist.all_gather_object(decisions, decision)
    assert decisions == [ref_decision] * world_size, (decisions, ref_decision, metrics, threshold)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, err

    # 3. a cache enabled before parallelize is reduced too
    before = copy.deepcopy(base)
    before.enable_cache(cfg)
    parallelize(before, mode="agkv", transport="torch", chunks=1)
    assert _head_hook(before)._cp_ops_group is not None
    _, decision = _two_steps(before, x1, x2, t, text)
    assert decision == ref_decision


def test_first_block_cache_agrees_across_ranks():
    run_ranks(_caches_agree, 2)


def test_seacache_refused():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    diffusers = pytest.importorskip("diffusers")
    if not hasattr(diffusers, "SeaCacheConfig"):
        pytest.skip("this diffusers has no SeaCache")
    from cp_ops.integrations.diffusers import agree_step_caches, parallelize
    from diffusers_tiny import build

    with pytest.raises(ValueError, match="not parallelized"):
        agree_step_caches(build("wan"))
    model = build("wan")
    try:
        model.enable_cache(diffusers.SeaCacheConfig())
    except Exception as e:  # noqa: BLE001 - a config this model cannot take: nothing to refuse
        pytest.skip(f"SeaCache not applicable to the tiny Wan: {e}")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="SeaCache.*decides from each rank's own tokens"):
            parallelize(model)
        assert getattr(model, "_cp_ops_group", None) is None  # refused before any hook went in
    finally:
        dist.destroy_process_group()
