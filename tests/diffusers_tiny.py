"""Tiny diffusers transformers (random seeded weights, fp32) and their inputs, for the CP model tests.

``build(name)`` returns the model; ``inputs(name, batch, size, text, gen, mask=False)`` returns forward kwargs with
``size`` image tokens-ish (the latent grid named by ``size``) and ``text`` text tokens; ``mask=True`` pads the
text of the last sample (its last 3 text tokens masked out; Z-Image: the samples' unified sequences differ in
length) where the model takes a text mask.
"""

from __future__ import annotations

import copy

import torch

H, D = 4, 8  # heads, head dim: W=2,4 divide H (Ulysses), W=3 runs AGKV
AX3 = (2, 2, 4)


#: name -> (diffusers class, tiny constructor arguments)
_CONFIGS = {
    "wan": ("WanTransformer3DModel", dict(patch_size=(1, 2, 2), num_attention_heads=H, attention_head_dim=D,
                                          in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                          num_layers=2)),
    "wan_vace": ("WanVACETransformer3DModel", dict(patch_size=(1, 2, 2), num_attention_heads=H, attention_head_dim=D,
                                                   in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                                   num_layers=2, vace_layers=[0], vace_in_channels=4)),
    "flux": ("FluxTransformer2DModel", dict(in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=D,
                                            num_attention_heads=H, joint_attention_dim=16, pooled_projection_dim=8,
                                            axes_dims_rope=AX3)),
    "flux2": ("Flux2Transformer2DModel", dict(in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=D,
                                              num_attention_heads=H, joint_attention_dim=16,
                                              timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2),
                                              guidance_embeds=False)),
    "qwenimage": ("QwenImageTransformer2DModel", dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                                      attention_head_dim=D, num_attention_heads=H,
                                                      joint_attention_dim=16, axes_dims_rope=AX3)),
    "ltx": ("LTXVideoTransformer3DModel", dict(in_channels=8, out_channels=8, num_attention_heads=H,
                                               attention_head_dim=D, cross_attention_dim=H * D, num_layers=2,
                                               caption_channels=16)),
    "zimage": ("ZImageTransformer2DModel", dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4,
                                                dim=H * D, n_layers=2, n_refiner_layers=1, n_heads=H, n_kv_heads=H,
                                                cap_feat_dim=16, axes_dims=list(AX3), axes_lens=[128, 64, 64])),
    "hunyuanvideo": ("HunyuanVideoTransformer3DModel", dict(in_channels=4, out_channels=4, num_attention_heads=H,
                                                            attention_head_dim=D, num_layers=1, num_single_layers=1,
                                                            num_refiner_layers=1, patch_size=2, text_embed_dim=16,
                                                            pooled_projection_dim=8, rope_axes_dim=AX3)),
}


def build(name: str, **config) -> torch.nn.Module:
    """The tiny ``name`` model; ``config``: constructor arguments that replace the tiny ones (e.g. ``num_layers=1``
    where a test's subject is one layer's, and more layers only add compile time)."""
    import diffusers as d

    torch.manual_seed(0)
    cls, kw = _CONFIGS[name]
    m = getattr(d, cls)(**copy.deepcopy({**kw, **config}))  # (the table's lists stay its own)
    for p in m.parameters():  # some zero-initialised layers (modulation, out projections) would hide errors
        if p.abs().max() == 0:
            torch.nn.init.normal_(p, std=0.1)
    return m.eval()


def inputs(name: str, b: int, size: tuple, text: int, gen: torch.Generator, mask: bool = False) -> dict:
    """``size``: (frames, height, width) of the latent grid in tokens (image models: frames ignored)."""
    f, h, w = size
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    t = torch.tensor([500.0, 300.0][:b])
    text_mask = torch.ones(b, text, dtype=torch.bool)
    if mask:
        text_mask[-1, -3:] = False
    if name in ("wan", "wan_vace"):
        kw = dict(hidden_states=r(b, 4, f, 2 * h, 2 * w), timestep=t.long(), encoder_hidden_states=r(b, text, 16))
        if name == "wan_vace":
            kw["control_hidden_states"] = r(b, 4, f, 2 * h, 2 * w)
        return kw
    if name == "flux":
        ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(h).float(), torch.arange(w).float(), indexing="ij"), -1)
        return dict(hidden_states=r(b, h * w, 8), encoder_hidden_states=r(b, text, 16), pooled_projections=r(b, 8),
                    timestep=t / 1000, img_ids=ids.reshape(-1, 3).float().clone(), txt_ids=torch.zeros(text, 3))
    if name == "flux2":
        ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(h).float(), torch.arange(w).float(), torch.zeros(1),
                                         indexing="ij"), -1).reshape(1, -1, 4).float().expand(b, -1, -1)
        return dict(hidden_states=r(b, h * w, 8), encoder_hidden_states=r(b, text, 16), timestep=t / 1000,
                    img_ids=ids, txt_ids=torch.zeros(b, text, 4))
    if name == "qwenimage":
        return dict(hidden_states=r(b, h * w, 16), encoder_hidden_states=r(b, text, 16),
                    encoder_hidden_states_mask=text_mask if mask else None, timestep=t / 1000,
                    img_shapes=[(1, h, w)] * b)
    if name == "ltx":
        return dict(hidden_states=r(b, f * h * w, 8), encoder_hidden_states=r(b, text, 16), timestep=t.long(),
                    encoder_attention_mask=text_mask.long(), num_frames=f, height=h, width=w)
    if name == "zimage":
        return dict(x=[r(4, 1, 2 * h, 2 * w) for _ in range(b)], t=t / 1000,
                    # Z-Image pads each caption to a multiple of 32 tokens; samples differ in length (so the model
                    # masks the shorter one's padding) only across such a boundary: +32 tokens for the last one
                    cap_feats=[r(text + (32 if mask and i == b - 1 else 0), 16) for i in range(b)])
    if name == "hunyuanvideo":
        return dict(hidden_states=r(b, 4, f, 2 * h, 2 * w), timestep=t.long(), encoder_hidden_states=r(b, text, 16),
                    encoder_attention_mask=text_mask.long(), pooled_projections=r(b, 8),
                    guidance=torch.tensor([3.5] * b))
    raise KeyError(name)


def sample(out):
    """The output sample: a tensor (Z-Image: its list of per-sample tensors stacked)."""
    s = out.sample if hasattr(out, "sample") else out[0]
    return torch.stack(s) if isinstance(s, list) else s
