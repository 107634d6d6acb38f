"""Tiny diffusers pipelines built in code (random seeded weights, no download, no text encoder): what
:mod:`cp_ops.examples.generate` runs when no checkpoint is given, and what the tests compare against.

Each builder returns ``(pipe, call_kwargs)``: the pipeline on the CPU in fp32 and the keyword arguments of one
``pipe(...)`` call (prompt embeddings instead of a prompt; add ``generator=``). Needs diffusers and transformers
(diffusers' pipeline classes are placeholders without the latter).
"""

from __future__ import annotations

import torch


def _randomize(*models: torch.nn.Module) -> None:
    """Zero-initialised layers (modulation, output projections) made random: a zero layer hides errors."""
    for m in models:
        for p in m.parameters():
            if p.abs().max() == 0:
                torch.nn.init.normal_(p, std=0.1)


def tiny_wan22(frames: int = 5, size: int = 32, steps: int = 2):
    """A Wan 2.2 A14B-style ``WanPipeline``: two expert transformers (``transformer`` for the high-noise steps,
    ``transformer_2`` below ``boundary_ratio``; with ``steps=2`` each runs one step), classifier-free guidance.
    ``frames`` video frames of ``size`` x ``size`` pixels: ``(frames - 1) / 4 + 1`` latent frames of ``size / 16``
    squared tokens each."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    experts = [WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                     in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32,
                                     num_layers=2, rope_max_seq_len=32) for _ in range(2)]
    _randomize(*experts)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(),
                       transformer=experts[0], transformer_2=experts[1], boundary_ratio=0.875)
    g = torch.Generator().manual_seed(1)
    call = dict(prompt_embeds=torch.randn(1, 8, 32, generator=g),
                negative_prompt_embeds=torch.randn(1, 8, 32, generator=g), height=size, width=size, num_frames=frames, num_inference_steps=steps, guidance_scale=4.0)
    return pipe, call


def tiny_flux(size: int = 16, steps: int = 2):
    """A ``FluxPipeline`` of ``size`` x ``size`` pixels (a VAE of scale 1: ``(size / 2)`` squared image tokens)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                        latent_channels=4, norm_num_groups=1, scaling_factor=1.0, shift_factor=0.0)
    tr = FluxTransformer2DModel(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                num_attention_heads=4, joint_attention_dim=16, pooled_projection_dim=8,
                                axes_dims_rope=(2, 2, 4))
    _randomize(tr)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=tr)
    g = torch.Generator().manual_seed(1)
    call = dict(prompt_embeds=torch.randn(1, 8, 16, generator=g), pooled_prompt_embeds=torch.randn(1, 8, generator=g),
                height=size, width=size, num_inference_steps=steps, guidance_scale=3.5)
    return pipe, call
