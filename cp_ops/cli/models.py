"""The DiTs ``cp-ops run`` / ``bound`` know: one :class:`ModelSpec` per family (diffusers class, released configs,
``--layers N`` depth, default latents, input builder, scheduler). ``tiny`` configs are the CPU default (same structure,
seconds). Latents are VAE space (pixels / 8; image models 1 frame); inputs come from one seeded generator, so every
rank builds the same full inputs.

Sources: the released checkpoints' ``transformer/config.json`` (Wan-AI/Wan2.1-T2V-1.3B/-14B-Diffusers,
Tongyi-MAI/Z-Image-Turbo, black-forest-labs/FLUX.1-dev/-schnell, Qwen/Qwen-Image, hunyuanvideo-community/HunyuanVideo);
input layouts and timestep conventions from the matching diffusers 0.42 pipelines.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


def _first(model, kw):
    return model(**kw)[0]


def _set_hidden(kw, x):
    kw["hidden_states"] = x


def _get_hidden(kw):
    return kw["hidden_states"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model family. ``gpu_latent``: the default latent ``[frames, height, width]`` on CUDA (the standard
    resolution); ``cpu_latent``: the tiny configs'. ``layer_keys``: what ``--layers N`` sets. ``text_tokens``: per
    config (the pipeline's ``max_sequence_length`` where it pads, else a typical prompt's). ``replicated``: modules
    whose work every rank repeats on full tensors (timestep and text embeddings), for ``--profile``."""

    name: str
    cls: str
    configs: dict[str, dict]
    gpu_config: str
    layer_keys: tuple[str, ...]
    text_tokens: dict[str, int]
    gpu_latent: tuple[int, int, int]
    cpu_latent: tuple[int, int, int]
    video: bool
    make_inputs: Callable[..., dict]
    model_timestep: Callable[[torch.Tensor], torch.Tensor]
    scheduler: Callable[[], Any]
    patch: Callable[[dict], tuple[int, int, int]]
    heads_key: str
    predict: Callable[[torch.nn.Module, dict], torch.Tensor] = _first  # the output tuple's first tensor
    set_latents: Callable[[dict, torch.Tensor], None] = _set_hidden
    get_latents: Callable[[dict], torch.Tensor] = _get_hidden
    replicated: tuple[str, ...] = ()
    blocks: tuple[str, ...] = ("blocks",)

    def config(self, name: str, layers: int | None = None) -> dict:
        cfg = dict(self.configs[name])
        if layers is not None:
            cfg.update(dict.fromkeys(self.layer_keys, layers))
        return cfg

    def tokens(self, cfg: dict, frames: int, height: int, width: int) -> int:
        pt, ph, pw = self.patch(cfg)
        return (frames // pt) * (height // ph) * (width // pw)

    def heads(self, cfg: dict) -> int:
        return cfg[self.heads_key]


def _randn(gen, *shape, device, dtype):
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _t_full(batch, t, device):
    return torch.full((batch,), float(t), device=device)


# ---- Wan 2.1 -------------------------------------------------------------------------------------------------

def _wan_inputs(cfg, text, batch, f, h, w, device, dtype, gen, t=500.0):
    return dict(hidden_states=_randn(gen, batch, cfg["in_channels"], f, h, w, device=device, dtype=dtype),
                timestep=torch.full((batch,), int(t), device=device, dtype=torch.long),
                encoder_hidden_states=_randn(gen, batch, text, cfg["text_dim"], device=device, dtype=dtype),
                return_dict=False)


def _unipc_flow(shift):
    def make():
        from diffusers import UniPCMultistepScheduler

        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                       num_train_timesteps=1000, flow_shift=shift)
    return make


def _flow_euler(shift):
    def make():
        from diffusers import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    return make


WAN = ModelSpec(
    name="wan", cls="WanTransformer3DModel",
    configs={
        "1.3b": dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, text_dim=4096,
                     freq_dim=256, in_channels=16, out_channels=16, patch_size=(1, 2, 2)),
        "14b": dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40, text_dim=4096,
                    freq_dim=256, in_channels=16, out_channels=16, patch_size=(1, 2, 2)),
        "tiny": dict(num_attention_heads=4, attention_head_dim=16, ffn_dim=128, num_layers=2, text_dim=32,
                     freq_dim=32, in_channels=4, out_channels=4, patch_size=(1, 2, 2)),
    },
    gpu_config="1.3b", layer_keys=("num_layers",), text_tokens={"1.3b": 512, "14b": 512, "tiny": 16},
    gpu_latent=(21, 60, 104), cpu_latent=(2, 16, 16), video=True,
    make_inputs=_wan_inputs, model_timestep=lambda t: t, scheduler=_unipc_flow(3.0),
    patch=lambda c: tuple(c["patch_size"]),
    heads_key="num_attention_heads", replicated=("condition_embedder", "attn2.to_k", "attn2.to_v", "attn2.norm_k"),
)


# ---- HunyuanVideo --------------------------------------------------------------------------------------------

def _text_mask(batch, text, device):
    """Key-padding mask of the text: item b has ``text - b * text // 4`` valid tokens (the rest padding),
    at least 1; int64 as the pipelines pass it."""
    m = torch.zeros(batch, text, dtype=torch.long, device=device)
    for b in range(batch):
        m[b, : max(1, text - b * (text // 4))] = 1
    return m


def _hunyuan_inputs(cfg, text, batch, f, h, w, device, dtype, gen, t=500.0):
    mask = torch.zeros(batch, text, dtype=torch.long, device=device)
    mask[:, : max(1, text * 3 // 4)] = 1  # the pipeline pads every prompt to max_sequence_length
    kw = dict(hidden_states=_randn(gen, batch, cfg["in_channels"], f, h, w, device=device, dtype=dtype),
              timestep=_t_full(batch, t, device).to(dtype),
              encoder_hidden_states=_randn(gen, batch, text, cfg["text_embed_dim"], device=device, dtype=dtype),
              encoder_attention_mask=mask,
              pooled_projections=_randn(gen, batch, cfg["pooled_projection_dim"], device=device, dtype=dtype),
              return_dict=False)
    if cfg.get("guidance_embeds", True):
        kw["guidance"] = torch.full((batch,), 6.0 * 1000.0, device=device, dtype=dtype)
    return kw


HUNYUAN = ModelSpec(
    name="hunyuanvideo", cls="HunyuanVideoTransformer3DModel",
    configs={
        "13b": dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                    qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                    rope_theta=256.0, rope_axes_dim=(16, 56, 56)),
        "tiny": dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, num_layers=1,
                     num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
                     qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=32, pooled_projection_dim=16,
                     rope_theta=256.0, rope_axes_dim=(4, 6, 6)),
    },
    gpu_config="13b", layer_keys=("num_layers", "num_single_layers"), text_tokens={"13b": 256, "tiny": 16},
    gpu_latent=(16, 68, 120), cpu_latent=(2, 16, 16), video=True,
    make_inputs=_hunyuan_inputs, model_timestep=lambda t: t, scheduler=_flow_euler(7.0),
    patch=lambda c: (c["patch_size_t"], c["patch_size"], c["patch_size"]), heads_key="num_attention_heads",
    replicated=("time_text_embed", "context_embedder"), blocks=("transformer_blocks", "single_transformer_blocks"),
)


# ---- Flux.1 and Qwen-Image: packed 2x2 latent patches -----------------------------------------------------

def _packed(gen, cfg, batch, h, w, device, dtype):
    """Latent ``[B, C, h, w]`` packed as the pipelines do: ``[B, (h/2)(w/2), C*4]`` (in_channels = C*4)."""
    return _randn(gen, batch, (h // 2) * (w // 2), cfg["in_channels"], device=device, dtype=dtype)


def _flux_inputs(cfg, text, batch, f, h, w, device, dtype, gen, t=500.0):
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] = torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = torch.arange(w // 2, device=device)[None, :]
    kw = dict(hidden_states=_packed(gen, cfg, batch, h, w, device, dtype),
              encoder_hidden_states=_randn(gen, batch, text, cfg["joint_attention_dim"], device=device, dtype=dtype),
              pooled_projections=_randn(gen, batch, cfg["pooled_projection_dim"], device=device, dtype=dtype),
              timestep=(_t_full(batch, t, device) / 1000).to(dtype),
              img_ids=ids.reshape(-1, 3).to(dtype), txt_ids=torch.zeros(text, 3, device=device, dtype=dtype),
              return_dict=False)
    if cfg.get("guidance_embeds"):
        kw["guidance"] = torch.full((batch,), 3.5, device=device, dtype=dtype)
    return kw


_FLUX_DEV = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                 guidance_embeds=True, axes_dims_rope=(16, 56, 56))
FLUX = ModelSpec(
    name="flux", cls="FluxTransformer2DModel",
    configs={
        "dev": _FLUX_DEV,
        "schnell": dict(_FLUX_DEV, guidance_embeds=False),
        "tiny": dict(patch_size=1, in_channels=16, out_channels=None, num_layers=1, num_single_layers=1,
                     attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=16,
                     guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
    },
    gpu_config="dev", layer_keys=("num_layers", "num_single_layers"),
    text_tokens={"dev": 512, "schnell": 256, "tiny": 7},
    gpu_latent=(1, 128, 128), cpu_latent=(1, 16, 16), video=False,
    make_inputs=_flux_inputs, model_timestep=lambda t: t / 1000, scheduler=_flow_euler(3.0),
    patch=lambda c: (1, 2, 2),
    heads_key="num_attention_heads", replicated=("time_text_embed", "context_embedder", "pos_embed"),
    blocks=("transformer_blocks", "single_transformer_blocks"),
)


def _qwen_inputs(cfg, text, batch, f, h, w, device, dtype, gen, t=500.0):
    mask = _text_mask(batch, text, device)
    return dict(hidden_states=_packed(gen, cfg, batch, h, w, device, dtype),
                encoder_hidden_states=_randn(gen, batch, text, cfg["joint_attention_dim"], device=device, dtype=dtype),
                # as QwenImagePipeline.encode_prompt passes it: no mask when every token is valid (one prompt)
                encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                timestep=(_t_full(batch, t, device) / 1000).to(dtype),
                img_shapes=[[(1, h // 2, w // 2)]] * batch, return_dict=False)


QWEN = ModelSpec(
    name="qwenimage", cls="QwenImageTransformer2DModel",
    configs={
        "20b": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56)),
        "tiny": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                     num_attention_heads=4, joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6)),
    },
    gpu_config="20b", layer_keys=("num_layers",), text_tokens={"20b": 128, "tiny": 7},
    gpu_latent=(1, 166, 166), cpu_latent=(1, 16, 16), video=False,
    make_inputs=_qwen_inputs, model_timestep=lambda t: t / 1000, scheduler=_flow_euler(3.0),
    patch=lambda c: (1, 2, 2), heads_key="num_attention_heads", replicated=("time_text_embed", "txt_norm", "txt_in"),
    blocks=("transformer_blocks",),
)


# ---- Z-Image: lists of per-item latents --------------------------------------------------------------------

def _zimage_inputs(cfg, text, batch, f, h, w, device, dtype, gen, t=500.0):
    return dict(x=[_randn(gen, cfg["in_channels"], 1, h, w, device=device, dtype=dtype) for _ in range(batch)],
                t=((1000 - _t_full(batch, t, device)) / 1000).to(dtype),
                cap_feats=[_randn(gen, text, cfg["cap_feat_dim"], device=device, dtype=dtype) for _ in range(batch)],
                return_dict=False)


def _zimage_predict(model, kw):
    return -torch.stack(model(**kw)[0])  # the pipeline negates: the model predicts -velocity


def _zimage_set(kw, x):
    kw["x"] = list(x.unbind(0))


ZIMAGE = ModelSpec(
    name="zimage", cls="ZImageTransformer2DModel",
    configs={
        "turbo": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                      n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                      rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512]),
        "tiny": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=2,
                     n_refiner_layers=1, n_heads=4, n_kv_heads=4, norm_eps=1e-5, qk_norm=True, cap_feat_dim=32,
                     rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32]),
    },
    gpu_config="turbo", layer_keys=("n_layers",), text_tokens={"turbo": 128, "tiny": 7},
    gpu_latent=(1, 128, 128), cpu_latent=(1, 16, 16), video=False,
    make_inputs=_zimage_inputs, predict=_zimage_predict, set_latents=_zimage_set,
    get_latents=lambda kw: torch.stack(kw["x"]), model_timestep=lambda t: (1000 - t) / 1000,
    scheduler=_flow_euler(3.0), patch=lambda c: (c["all_f_patch_size"][0], c["all_patch_size"][0], c["all_patch_size"][0]),
    heads_key="n_heads", replicated=("t_embedder", "cap_embedder", "context_refiner"), blocks=("layers",),
)

# ---- LTX-Video: packed latent tokens, 32x spatial / 8x temporal VAE ----------------------------------------

def _ltx_inputs(cfg, text, batch, f, h, w, device, dtype, gen, t=500.0):
    """As ``LTXPipeline`` calls the transformer: latents packed ``[B, F*H*W, C]`` (patch 1), the T5 text with its
    padding mask, ``t`` in [0, 1000], the latent grid for the RoPE and the VAE's compression as its interpolation
    scale (8 / 25 fps temporal, 32 spatial)."""
    return dict(hidden_states=_randn(gen, batch, f * h * w, cfg["in_channels"], device=device, dtype=dtype),
                encoder_hidden_states=_randn(gen, batch, text, cfg["caption_channels"], device=device, dtype=dtype),
                timestep=_t_full(batch, t, device).to(dtype), encoder_attention_mask=_text_mask(batch, text, device),
                num_frames=f, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32), return_dict=False)


LTX = ModelSpec(
    name="ltx", cls="LTXVideoTransformer3DModel",
    configs={
        # Lightricks/LTX-Video (0.9) transformer/config.json = the class defaults
        "2b": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                   attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
                   qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
                   caption_channels=4096, attention_bias=True, attention_out_bias=True),
        "tiny": dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
                     attention_head_dim=16, cross_attention_dim=64, num_layers=2, activation_fn="gelu-approximate",
                     qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
                     caption_channels=32, attention_bias=True, attention_out_bias=True),
    },
    # latent = pixels / 32 (frames: (n - 1) / 8 + 1): 768x512, 121 frames = 16 x 16 x 24 = 6144 tokens
    gpu_config="2b", layer_keys=("num_layers",), text_tokens={"2b": 128, "tiny": 16},
    gpu_latent=(16, 16, 24), cpu_latent=(2, 8, 8), video=True,
    make_inputs=_ltx_inputs, model_timestep=lambda t: t, scheduler=_flow_euler(1.0),
    patch=lambda c: (c["patch_size_t"], c["patch_size"], c["patch_size"]),
    heads_key="num_attention_heads", replicated=("time_embed", "caption_projection"),
    blocks=("transformer_blocks",),
)

MODELS: dict[str, ModelSpec] = {s.name: s for s in (WAN, ZIMAGE, FLUX, QWEN, HUNYUAN, LTX)}


def config_label(spec: ModelSpec, config: str, cfg: dict) -> str:
    """``config`` as a result row names it: the released config's name, and ``" (L of R layers)"`` when ``cfg`` (the
    config built) has fewer blocks than the released one (``--layers``), so a reduced-depth row says so."""
    if config not in spec.configs:
        return config
    used = [cfg[k] for k in spec.layer_keys]
    released = [spec.configs[config][k] for k in spec.layer_keys]
    if used == released:
        return config
    return f"{config} ({'+'.join(map(str, used))} of {'+'.join(map(str, released))} layers)"


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast floating parameters/buffers to ``dtype`` as ``from_pretrained(torch_dtype=...)`` does: modules the
    class keeps in fp32 (``_keep_in_fp32_modules``) stay fp32, and non-fp32 buffers (fp64 RoPE tables) are left."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.dtype == torch.float32 and not any(k in name.split(".") for k in keep):
            t.data = t.data.to(dtype)
    return model


def build(spec: ModelSpec, config: str, layers: int | None, device, dtype, seed: int = 0):
    """The transformer of ``spec`` at ``config`` (``layers`` blocks of each kind when given), random weights from
    ``torch.manual_seed(seed)``, cast with :func:`cast_like_from_pretrained`, in eval mode. Returns ``(model, cfg)``."""
    import diffusers

    cfg = spec.config(config, layers)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(diffusers, spec.cls)(**cfg)
    model = cast_like_from_pretrained(model, dtype).eval()
    if torch.device(device).type == "cuda":  # the fp32 weights' blocks, freed by the cast: other processes may need them
        torch.cuda.empty_cache()
    return model, cfg


def checkpoint_folder(path: str) -> str | None:
    """``'transformer'`` when ``path`` is a pipeline folder, None when it is the transformer folder itself."""
    import os

    return "transformer" if os.path.isfile(os.path.join(path, "transformer", "config.json")) else None


def checkpoint_config(path: str) -> dict:
    """The transformer config (``config.json``, as a dict with its ``_class_name``) of a local diffusers checkpoint
    ``path`` (a pipeline folder or the transformer folder). Raises ``ValueError`` when there is none."""
    import json
    import os

    cfg_file = os.path.join(path, checkpoint_folder(path) or "", "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"--checkpoint {path}: no config.json there nor in {path}/transformer")
    with open(cfg_file) as f:
        return json.load(f)


def load_checkpoint(spec: ModelSpec, path: str, device, dtype):
    """The transformer of a local diffusers checkpoint: ``path`` is a pipeline folder (with ``transformer/``) or
    the transformer folder itself. Raises ``ValueError`` when its class is not ``spec.cls``."""
    import diffusers

    sub = checkpoint_folder(path)
    cls = checkpoint_config(path).get("_class_name")
    if cls != spec.cls:
        raise ValueError(f"--checkpoint {path} holds a {cls}; `cp-ops run {spec.name}` takes a {spec.cls}")
    model = getattr(diffusers, spec.cls).from_pretrained(path, subfolder=sub, **dtype_kwarg(dtype))
    return model.to(device).eval(), dict(model.config)


def dtype_kwarg(dtype) -> dict:
    """``from_pretrained``'s dtype keyword: ``dtype=`` where diffusers takes it (it has
    ``deprecation_utils._resolve_dtype``), else ``torch_dtype=`` (older diffusers)."""
    import importlib

    dep = importlib.import_module("diffusers.utils.deprecation_utils")
    return {"dtype" if hasattr(dep, "_resolve_dtype") else "torch_dtype": dtype}
