"""CFG lanes in diffusers pipelines that call the transformer once per branch (Wan 2.2 with two experts,
Qwen-Image, Flux with true CFG, HunyuanVideo): ``parallelize_pipeline(pipe, cfg_parallel=True)`` runs the conditional
call on lane 0 and the unconditional one on lane 1 — each lane runs only its branch's forwards — and gives the
unparallelized pipeline's output, at W = 2 (2 lanes x CP1: bitwise) and W = 4 (2 lanes x CP2). A pipeline that
batches [uncond, cond] (LTX) keeps the batch split over the lanes. A call with no CFG pair runs over all W ranks,
with one warning; a conditional call left without its unconditional call raises on every rank."""

import importlib.util
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
NEEDS = [m for m in ("transformers",) if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(NEEDS), reason=f"diffusers pipelines need {NEEDS} (pip install transformers)")

from dist_util import run_ranks  # noqa: E402


def tiny_qwenimage(steps: int = 2, true_cfg: float = 4.0):
    """A ``QwenImagePipeline`` of 32 x 32 pixels (4 image tokens), true CFG with a negative prompt of another length
    and a text mask that pads it."""
    import diffusers as d

    from cp_ops.examples.tiny import _randomize

    torch.manual_seed(0)
    vae = d.AutoencoderKLQwenImage(base_dim=4, z_dim=4, latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
                                   dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    tr = d.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                       attention_head_dim=8, num_attention_heads=4, joint_attention_dim=16,
                                       axes_dims_rope=(2, 2, 4))
    _randomize(tr)
    pipe = d.QwenImagePipeline(scheduler=d.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                               tokenizer=None, transformer=tr)
    g = torch.Generator().manual_seed(1)
    neg_mask = torch.ones(1, 6, dtype=torch.long)
    neg_mask[0, -2:] = 0
    call = dict(prompt_embeds=torch.randn(1, 8, 16, generator=g), prompt_embeds_mask=torch.ones(1, 8, dtype=torch.long),
                negative_prompt_embeds=torch.randn(1, 6, 16, generator=g), negative_prompt_embeds_mask=neg_mask,
                true_cfg_scale=true_cfg, height=32, width=32, num_inference_steps=steps)
    return pipe, call


def tiny_flux_true_cfg(steps: int = 2):
    """:func:`cp_ops.examples.tiny.tiny_flux` with true CFG (a negative prompt's embeddings, ``true_cfg_scale``)."""
    from cp_ops.examples.tiny import tiny_flux

    pipe, call = tiny_flux(steps=steps)
    g = torch.Generator().manual_seed(2)
    call.update(negative_prompt_embeds=torch.randn(1, 8, 16, generator=g),
                negative_pooled_prompt_embeds=torch.randn(1, 8, generator=g), true_cfg_scale=3.0)
    return pipe, call


def tiny_hunyuanvideo(steps: int = 2):
    """A ``HunyuanVideoPipeline``: 5 frames of 32 x 32 pixels (2 latent frames of 4 tokens), true CFG."""
    import diffusers as d

    from cp_ops.examples.tiny import _randomize

    torch.manual_seed(0)
    vae = d.AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(4,) * 4, layers_per_block=1,
        norm_num_groups=2, spatial_compression_ratio=8, temporal_compression_ratio=4, mid_block_add_attention=False)
    tr = d.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8,
                                          num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
                                          text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    _randomize(tr)
    pipe = d.HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=tr, vae=vae,
                                  scheduler=d.FlowMatchEulerDiscreteScheduler(), text_encoder_2=None, tokenizer_2=None)
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ones = torch.ones(1, 8, dtype=torch.long)
    call = dict(prompt_embeds=r(1, 8, 16), pooled_prompt_embeds=r(1, 8), prompt_attention_mask=ones,
                negative_prompt_embeds=r(1, 8, 16), negative_pooled_prompt_embeds=r(1, 8),
                negative_prompt_attention_mask=ones, true_cfg_scale=3.0, height=32, width=32, num_frames=5,
                num_inference_steps=steps)
    return pipe, call


def tiny_ltx(steps: int = 2):
    """An ``LTXPipeline`` (cond and uncond in one call, a batch of 2): 9 frames of 32 x 32 pixels."""
    import diffusers as d

    from cp_ops.examples.tiny import _randomize

    torch.manual_seed(0)
    five = (1,) * 5
    vae = d.AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8,) * 4,
        decoder_block_out_channels=(8,) * 4, layers_per_block=five, decoder_layers_per_block=five,
        spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1,) * 4,
        timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    tr = d.LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=8,
                                      cross_attention_dim=32, num_layers=2, caption_channels=16)
    _randomize(tr)
    pipe = d.LTXPipeline(scheduler=d.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                         transformer=tr)
    g = torch.Generator().manual_seed(1)
    ones = torch.ones(1, 8, dtype=torch.long)
    call = dict(prompt_embeds=torch.randn(1, 8, 16, generator=g), prompt_attention_mask=ones,
                negative_prompt_embeds=torch.randn(1, 8, 16, generator=g), negative_prompt_attention_mask=ones,
                guidance_scale=3.0, height=32, width=32, num_frames=9, num_inference_steps=steps)
    return pipe, call


def _cfg_off(pipe, i, t, kwargs):
    """A step-end callback that turns CFG off after its step (the pipeline's own do_classifier_free_guidance then
    says no)."""
    pipe._guidance_scale = 1.0
    return {}


def _output(pipe, call):
    with torch.no_grad():
        out = pipe(**call, generator=torch.Generator().manual_seed(0), output_type="np")
    return out.frames if hasattr(out, "frames") else out.images


def _count_forwards(pipe, names):
    """Forwards each transformer ran (a pre-hook: runs inside the call, where a lane that skips a branch does not)."""
    calls = dict.fromkeys(names, 0)
    for n in names:
        getattr(pipe, n).register_forward_pre_hook(lambda *a, n=n: calls.__setitem__(n, calls[n] + 1))
    return calls


def _cfg_pipelines(rank, w):
    from cp_ops.examples.tiny import tiny_flux, tiny_wan22
    from cp_ops.integrations.diffusers import parallelize_pipeline

    lane = rank // (w // 2)
    # (builder, transformers, forwards each runs per lane: its branch's only; LTX: a batch of 2, split by lane)
    cases = [(tiny_wan22, ("transformer", "transformer_2"), 1), (tiny_qwenimage, ("transformer",), 2),
             (tiny_flux_true_cfg, ("transformer",), 2)]
    # one more video pipeline per W (their VAEs cost the most): the batched one with even lanes, HunyuanVideo on CP2
    cases += [(tiny_ltx, ("transformer",), 2)] if w == 2 else [(tiny_hunyuanvideo, ("transformer",), 2)]
    for build, names, per_lane in cases:
        ref_pipe, call = build()
        ref_pipe.set_progress_bar_config(disable=True)
        ref = _output(ref_pipe, call)
        pipe, call = build()
        parallelize_pipeline(pipe, mode="agkv", transport="torch", chunks=1, cfg_parallel=True)
        calls = _count_forwards(pipe, names)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a paired pipeline runs without the both-lanes warning
            out = _output(pipe, call)
        # each lane ran only its own branch: one forward per step and transformer, not two
        assert calls == dict.fromkeys(names, per_lane), (build.__name__, lane, calls)
        assert out.shape == ref.shape and out.std() > 0, (build.__name__, out.shape, ref.shape)
        if build is tiny_ltx:  # each lane runs batch 1 where the reference ran batch 2: equal to rounding
            assert np.abs(out - ref).max() <= 1e-5, (build.__name__, w, np.abs(out - ref).max())
        elif w == 2 or build is tiny_wan22:  # the same kernels on the same data (CP1, or one stream in even shards)
            assert np.array_equal(out, ref), (build.__name__, w, np.abs(out - ref).max())
        else:  # joint attention over CP2 sees its keys in another order: equal to rounding
            assert np.abs(out - ref).max() <= 1e-5, (build.__name__, w, np.abs(out - ref).max())
        out2 = _output(pipe, call)  # a second call: the output shapes are known, nothing is asked again
        assert np.array_equal(out2, out), build.__name__

    # a step cache: FirstBlockCache decides per branch from the branch's own tokens (reduced over the lane that runs
    # it, not over both lanes: that would mix the two branches' metrics). At threshold 0.35 one device skips the
    # conditional branch at step 2 (metric 0.33) but computes the unconditional one (0.38): a mixed metric differs
    from diffusers import FirstBlockCacheConfig

    outs = []
    for parallel in (False, True):
        pipe, call = tiny_qwenimage(steps=3)
        pipe.set_progress_bar_config(disable=True)
        if parallel:
            parallelize_pipeline(pipe, mode="agkv", transport="torch", chunks=1, cfg_parallel=True)
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.35))
        outs.append(_output(pipe, call))
    err = np.abs(outs[1] - outs[0]).max()
    assert err <= (0 if w == 2 else 1e-5), ("FirstBlockCache", err)

    # the whole forward captured (cp_ops.captured's CPU stand-in for CUDA graphs: the keys, static inputs, clones and
    # the ranks' agreement on each capture run for real): each lane captures its own branch's calls, agreeing within
    # the lane
    from test_captured import Recorder

    from cp_ops import captured

    captured.BACKEND = Recorder()
    ref_pipe, call = tiny_qwenimage()
    ref_pipe.set_progress_bar_config(disable=True)
    ref = _output(ref_pipe, call)
    pipe, call = tiny_qwenimage()
    parallelize_pipeline(pipe, mode="agkv", transport="torch", chunks=1, cfg_parallel=True, cuda_graphs="forward")
    for _ in range(2):  # the second call replays
        out = _output(pipe, call)
        assert np.abs(out - ref).max() <= (0 if w == 2 else 1e-5), ("captured", np.abs(out - ref).max())
    assert captured.captured(pipe.transformer).captures == 1, captured.captured(pipe.transformer).keys()
    assert "replay" in captured.BACKEND.events
    captured.BACKEND = captured.CudaGraphs()  # the CPU again: nothing captured below

    # no true CFG (one call per step): every rank runs it, CP over all W ranks, with one warning
    ref_pipe, call = tiny_flux()
    ref_pipe.set_progress_bar_config(disable=True)
    ref = _output(ref_pipe, call)
    pipe, call = tiny_flux()
    parallelize_pipeline(pipe, mode="agkv", transport="torch", chunks=1, cfg_parallel=True)
    calls = _count_forwards(pipe, ("transformer",))
    with pytest.warns(UserWarning, match="FluxPipeline runs FluxTransformer2DModel where classifier-free guidance "
                                         rf"is off in this call: this forward runs over all {w} ranks \(CP{w}\)"):
        out = _output(pipe, call)
    assert calls == {"transformer": 2}, calls
    # joint attention over CP W sees its keys in another order: equal to rounding
    assert out.shape == ref.shape and np.abs(out - ref).max() <= 1e-5, np.abs(out - ref).max()

    # a rule that says "paired" where the pipeline makes no unconditional call: raises on every rank, and the
    # pipeline stays usable
    from cp_ops.integrations.diffusers import lanes

    saved = lanes.PAIRED["FluxPipeline"]
    lanes.PAIRED["FluxPipeline"] = lambda pipe, args: True
    try:
        with pytest.raises(RuntimeError, match=r"cfg_parallel=True: FluxPipeline called FluxTransformer2DModel again "
                                               r"after a conditional call of FluxTransformer2DModel with no "
                                               r"unconditional call between.*parallelize_pipeline\(pipe, "
                                               r"cfg_parallel=False\) runs this pipeline"):
            _output(pipe, call)
    finally:
        lanes.PAIRED["FluxPipeline"] = saved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = _output(pipe, call)
    assert np.array_equal(again, out)


@pytest.mark.parametrize("world_size", [2, 4])
def test_cfg_lanes_in_pipelines_equal_unparallelized(world_size):
    run_ranks(_cfg_pipelines, world_size)


def _unpaired_over_all(rank, w):
    """A call the lanes cannot pair (Qwen-Image without a negative prompt) runs over all W ranks: every attention call
    CP over W (not W/2), the unparallelized output; unpaired and paired calls in a row each run on their own width,
    the whole forward captured per width (a graph is replayed only on the group it was captured for); a forward over
    all ranks that raises leaves the next calls working."""
    from test_captured import Recorder

    from cp_ops import captured
    from cp_ops.integrations.diffusers import dispatch, parallelize_pipeline

    widths = []  # the CP group size of every attention call
    real = dispatch.attention

    def attention(*args, group, **kwargs):
        widths.append(group.size())
        return real(*args, group=group, **kwargs)

    dispatch.attention = attention
    paired = tiny_qwenimage()[1]
    calls = {"paired": paired, "unpaired": {k: v for k, v in paired.items() if not k.startswith("negative")}}
    refs = {}
    for name, call in calls.items():
        ref_pipe, _ = tiny_qwenimage()
        ref_pipe.set_progress_bar_config(disable=True)
        refs[name] = _output(ref_pipe, call)

    class OnItsGroup(Recorder):
        """Replays only on the group the graph was captured for, as a CUDA graph's collectives run."""

        def capture(self, fn, pool, device):
            pg = state.pg
            replay, out = super().capture(fn, pool, device)

            def replay_on_its_group():
                assert state.pg is pg, f"a graph captured on CP{pg.size()} replayed on CP{state.pg.size()}"
                replay()
            return replay_on_its_group, out

    captured.BACKEND = OnItsGroup()
    pipe, _ = tiny_qwenimage()
    parallelize_pipeline(pipe, mode="agkv", transport="torch", chunks=1, cfg_parallel=True, cuda_graphs="forward")
    state = pipe.transformer._cp_ops_state
    for i, name in enumerate(("paired", "unpaired", "paired", "unpaired")):
        widths.clear()
        if i == 1:
            with pytest.warns(UserWarning, match="QwenImagePipeline runs QwenImageTransformer2DModel where "
                                                 "classifier-free guidance is off in this call: this forward runs "
                                                 rf"over all {w} ranks \(CP{w}\)"):
                out = _output(pipe, calls[name])
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # warned once
                out = _output(pipe, calls[name])
        assert set(widths) == {w if name == "unpaired" else w // 2}, (i, name, widths)
        err = np.abs(out - refs[name]).max()
        assert err <= 1e-5, (i, name, err)  # joint attention sees its keys in another order: rounding
    cf = captured.captured(pipe.transformer)
    assert cf.captures == 2 and "replay" in captured.BACKEND.events, cf.keys()  # its branch's graph, the whole one's

    # the transformer called outside pipe(...) with a batch of 1: over all ranks too
    import diffusers_tiny

    kw = diffusers_tiny.inputs("qwenimage", 1, (1, 2, 4), 8, torch.Generator().manual_seed(5))
    widths.clear()
    with torch.no_grad():
        ref = ref_pipe.transformer(**kw, return_dict=False)[0]
        with pytest.warns(UserWarning, match="QwenImageTransformer2DModel is called outside a pipeline call with a "
                                             f"batch of 1 .*: this forward runs over all {w} ranks"):
            out = pipe.transformer(**kw, return_dict=False)[0]
    assert set(widths) == {w} and (out - ref).abs().max() <= 1e-5, (widths, (out - ref).abs().max())

    # a forward over all ranks that raises (on every rank: each rank runs it): the next calls run
    seen = [0]

    def fail_once(*_):
        seen[0] += 1
        if seen[0] == 2:
            raise RuntimeError("boom over all ranks")

    h = pipe.transformer.register_forward_pre_hook(fail_once)
    with pytest.raises(RuntimeError, match="^boom over all ranks$"):
        _output(pipe, calls["unpaired"])
    h.remove()
    assert state.pg is pipe.transformer._cp_ops_group  # the lane's group again
    for name in ("paired", "unpaired"):
        assert np.abs(_output(pipe, calls[name]) - refs[name]).max() <= 1e-5, name
    captured.BACKEND = captured.CudaGraphs()

    # a step cache in a call whose CFG stops after step 1 (a callback): step 1 paired, the steps after over all ranks
    # with their own FirstBlockCache state (a lane's residual is split otherwise, and only lane 0 ran 'cond')
    from diffusers import FirstBlockCacheConfig

    from cp_ops.examples.tiny import tiny_wan22

    outs = []
    for parallel in (False, True):
        wan, call = tiny_wan22(steps=3)
        wan.register_to_config(boundary_ratio=None)  # one expert runs every step
        wan.set_progress_bar_config(disable=True)
        if parallel:
            parallelize_pipeline(wan, mode="agkv", transport="torch", chunks=1, cfg_parallel=True)
        wan.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.01))  # computes every step, as one device
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs.append(_output(wan, {**call, "callback_on_step_end": _cfg_off}))
    assert np.abs(outs[1] - outs[0]).max() <= 1e-5, np.abs(outs[1] - outs[0]).max()

    # CFG lanes of a 3-D mesh: no 2-D mesh spans every rank, so a call with no CFG pair runs on both lanes alike,
    # the warning says why
    from torch.distributed.device_mesh import init_device_mesh

    pipe, _ = tiny_qwenimage()
    mesh = init_device_mesh("cpu", (2, 1, w // 2), mesh_dim_names=("cfg", "agkv", "ulysses"))
    parallelize_pipeline(pipe, mesh, transport="torch", chunks=1)
    widths.clear()
    with pytest.warns(UserWarning, match=r"both CFG lanes run this forward alike \(CP over half the ranks each; not "
                                         rf"over all {w}: a 3-D mesh gives each lane a 2-D CP mesh"):
        out = _output(pipe, calls["unpaired"])
    assert set(widths) == {w // 2} and np.abs(out - refs["unpaired"]).max() <= 1e-5, widths


def test_a_call_the_lanes_cannot_pair_runs_over_all_ranks(monkeypatch):
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "20")  # ranks that run different checks fail in seconds, not minutes
    run_ranks(_unpaired_over_all, 4)


# ---- GPU (marked gpu; skipped without 2 GPUs): NCCL, one GPU a lane ----

def _on_device(call: dict, dev) -> dict:
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in call.items()}


def _cuda_cfg_pipelines(rank, w):
    """2 lanes x CP1 on NCCL (the default capture on): the paired pipelines equal the unparallelized ones; where the
    transformers replay captured graphs, a second call's transformer calls (shapes known) make no host sync — each
    lane's host returns while its GPU computes, the exchange included."""
    import numpy as np

    from cp_ops import captured
    from cp_ops.examples.tiny import tiny_wan22
    from cp_ops.integrations.diffusers import parallelize_pipeline

    dev = torch.device("cuda", rank)
    for build in (tiny_wan22, tiny_qwenimage, tiny_flux_true_cfg):
        ref_pipe, call = build()
        ref_pipe.to(dev).set_progress_bar_config(disable=True)
        ref = _output(ref_pipe, _on_device(call, dev))
        pipe, call = build()
        parallelize_pipeline(pipe, device=dev, mode="agkv", chunks=1, cfg_parallel=True)
        call = _on_device(call, dev)
        out = _output(pipe, call)
        assert np.abs(out - ref).max() <= 1e-4, (build.__name__, np.abs(out - ref).max())  # other kernels: rounding
        syncs = []

        def no_sync(inner, args, kwargs, call_):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return call_(inner, args, kwargs)
            except RuntimeError as e:
                syncs.append(str(e).splitlines()[0])
                raise
            finally:
                torch.cuda.set_sync_debug_mode("default")

        graphed = all(getattr(captured.captured(getattr(pipe, n)), "eager_why", "none") is None
                      for n in pipe.cp_ops_transformers)
        if graphed:
            for n in pipe.cp_ops_transformers:
                lanes = getattr(pipe, n)._cp_ops_lanes
                lanes.call = lambda inner, a, k, call_=lanes.call: no_sync(inner, a, k, call_)
        again = _output(pipe, call)
        assert not syncs and np.array_equal(again, out), (build.__name__, syncs)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_cfg_lanes_in_pipelines():
    run_ranks(_cuda_cfg_pipelines, 2, timeout=600, device="cuda")
