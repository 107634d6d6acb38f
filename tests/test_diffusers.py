"""parallelize() on a tiny diffusers Wan transformer equals the unparallelized model (gloo, 2 and 4 ranks)."""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from dist_util import run_ranks  # noqa: E402


def _tiny_wan(heads):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=16,
                                 in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                                 num_layers=2).eval()


def _wan_equal(rank, w):
    from cp_ops.integrations.diffusers import parallelize
    from cp_ops.integrations.diffusers.dispatch import CPAttention

    model = _tiny_wan(heads=4)
    g = torch.Generator().manual_seed(1)
    for b, frames, hw in [(1, 2, 8), (2, 4, 4)]:
        x = torch.randn(b, 4, frames, hw, hw, generator=g)
        t = torch.tensor([500, 300][:b])
        text = torch.randn(b, 16, 32, generator=g)
        with torch.no_grad():
            ref = model(x, t, text).sample
            for mode in ("agkv", "ulysses"):
                cp_model = parallelize(copy.deepcopy(model), mode=mode, transport="torch")
                # self-attention goes through cp_ops at diffusers' dispatch; cross-attention stays local
                assert isinstance(cp_model.blocks[0].attn1.processor._parallel_config, CPAttention)
                assert cp_model.blocks[0].attn2.processor._parallel_config is None
                out = cp_model(x, t, text).sample
                assert out.shape == ref.shape
                # the same kernels see the same data: bitwise equal on CPU
                assert torch.equal(out, ref), (mode, (out - ref).abs().max().item())


@pytest.mark.parametrize("world_size", [2])  # W = 3, 4 and the other models: test_diffusers_models.py
def test_parallelize_wan_equals_original(world_size):
    run_ranks(_wan_equal, world_size)


def _wan_chunks(rank, w):
    """parallelize(chunks=...) reaches every CP attention call: chunks=2 pipelines the even calls (fp32 ≤ 1e-5 vs
    the unparallelized model; not bitwise: the LSE merge), seq_lens calls (uneven shards) get chunks=1 (≤ 1e-5: as
    without chunks); chunks=1 on even shards is bitwise."""
    from cp_ops.integrations.diffusers import dispatch, parallelize

    model = _tiny_wan(heads=4)
    seen = []
    real = dispatch.attention

    def spy(*args, **kw):
        seen.append((kw["chunks"], "seq_lens" in kw))
        return real(*args, **kw)

    dispatch.attention = spy
    g = torch.Generator().manual_seed(3)
    try:
        for frames, hw, even in [(2, 8, True), (3, 2, False)]:  # 32 tokens; 3 tokens (uneven over 2 ranks)
            x = torch.randn(1, 4, frames, hw, hw, generator=g)
            t = torch.tensor([400])
            text = torch.randn(1, 16, 32, generator=g)
            with torch.no_grad():
                ref = model(x, t, text).sample
                for chunks in (2, 1):
                    cp_model = parallelize(copy.deepcopy(model), mode="agkv", transport="torch", chunks=chunks)
                    assert "chunks=" + str(chunks) in repr(cp_model.blocks[0].attn1.processor._parallel_config)
                    seen.clear()
                    out = cp_model(x, t, text).sample
                    assert len(seen) == 2 and all(u == (not even) for _, u in seen), seen  # 2 layers, self-attention
                    assert all(c == (chunks if even else 1) for c, _ in seen), (chunks, seen)
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    if chunks == 1 and even:
                        assert torch.equal(out, ref), (frames, chunks, err)
                    else:  # pipelined: the LSE merge; uneven: padded keys (SDPA sums in another order)
                        assert err <= 1e-5 and (err > 0 or not even), (frames, chunks, err)
    finally:
        dispatch.attention = real


def test_parallelize_chunks():
    run_ranks(_wan_chunks, 2)


def test_parallelize_rejects_other_models():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_ops.integrations.diffusers import parallelize

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="supports .*WanTransformer3DModel.*got Linear"):
            parallelize(torch.nn.Linear(2, 2))
        with pytest.raises(ValueError, match="mode must be one of"):
            parallelize(_tiny_wan(heads=2), mode="ring")
        for bad in (0, -2, 1.5, True, "2"):
            with pytest.raises(ValueError, match="chunks must be None"):
                parallelize(_tiny_wan(heads=2), chunks=bad)
        model = parallelize(_tiny_wan(heads=2))
        with pytest.raises(ValueError, match="already parallelized over CP group"):
            parallelize(model)
    finally:
        dist.destroy_process_group()


def test_parallelize_clear_errors():
    """Unknown model (lists the supported ones, says how to add one), unsupported mask kinds, odd CFG lanes."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_ops.integrations.diffusers import SUPPORTED, parallelize
    from cp_ops.integrations.diffusers.dispatch import CPAttention
    from diffusers_tiny import build

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        with pytest.raises(ValueError, match=r"supports \('WanTransformer3DModel', .*'HunyuanVideoTransformer3DModel'\); "
                                             r"got Linear\. To add a model: one ModelSpec line"):
            parallelize(torch.nn.Linear(2, 2))
        assert len(SUPPORTED) == 9 and "LTX2VideoTransformer3DModel" in SUPPORTED
        with pytest.raises(ValueError, match="two equal lanes; the group has 3 ranks"):
            parallelize(build("wan"), cfg_parallel=True)
        import diffusers

        hv = diffusers.HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, text_embed_dim=16, pooled_projection_dim=8,
            rope_axes_dim=(2, 2, 4), image_condition_type="token_replace")
        with pytest.raises(ValueError, match="token_replace' is not supported"):
            parallelize(hv)
        attn = CPAttention(state=None, streams=("image",), where="blocks.0.attn1")
        q = torch.randn(2, 5, 2, 8)
        assert attn.key_mask(None, q) is None
        ok = torch.rand(2, 1, 1, 5) > 0.3
        assert torch.equal(attn.key_mask(ok, q), ok[:, 0, 0])
        for bad, what in [(torch.zeros(2, 1, 1, 5), "torch.float32"),  # additive float mask
                          (torch.ones(2, 1, 5, 5, dtype=torch.bool), r"\(2, 1, 5, 5\)")]:  # per-query mask
            with pytest.raises(ValueError, match=rf"key-padding masks only .* got .*{what}"):
                attn.key_mask(bad, q)
    finally:
        dist.destroy_process_group()


def test_cp_ops_backend_refuses_calls_without_its_config():
    """A routed processor path that bypasses parallel_config would attend to local tokens only: it raises."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from cp_ops.integrations.diffusers import _private
    from cp_ops.integrations.diffusers.dispatch import cp_ops_backend

    member = _private.register_backend(cp_ops_backend)
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="called without its CP config"):
        dispatch_attention_fn(q, q, q, backend=member)
