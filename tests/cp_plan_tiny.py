"""Every diffusers transformer class that ships a ``_cp_plan`` (found in the installed diffusers' source, not
listed by hand), a tiny config of it (the class's ``__init__`` defaults with layers, heads and widths scaled down)
and inputs for it, for tests/test_cp_plan_models.py.

``classes()`` -> ``{class name: class}``; ``TINY[name]`` = ``(config overrides, inputs(b, grid, text, gen))`` where
``grid`` = (frames, height, width) of the latent grid in tokens; a class without an entry is reported by the test
(never dropped).
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import torch

from diffusers_tiny import AX3, D, H
from diffusers_tiny import inputs as _legacy_inputs


def classes() -> dict[str, type]:
    """Every class in ``diffusers.models`` whose own body sets ``_cp_plan`` (modules found by a text search of the
    installed source, then imported: importing every model module would take ~15 s)."""
    import diffusers.models as models

    root = pathlib.Path(models.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        if path.name == "_modeling_parallel.py" or not re.search(r"^\s+_cp_plan\s*=\s*\{", path.read_text(), re.M):
            continue
        mod = importlib.import_module("diffusers.models." + ".".join(path.relative_to(root).with_suffix("").parts))
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and obj.__module__ == mod.__name__ and obj.__dict__.get("_cp_plan"):
                found[name] = obj
    return found


def build(cls: type, overrides: dict) -> torch.nn.Module:
    """``cls(**defaults | overrides)`` with seeded random weights (zero-initialised layers made random: a zero
    modulation or output projection would hide errors), fp32, eval."""
    params = inspect.signature(cls.__init__).parameters
    unknown = [k for k in overrides if k not in params]
    assert not unknown, f"{cls.__name__}.__init__ takes no {unknown}"
    torch.manual_seed(0)
    m = cls(**overrides)
    for p in m.parameters():
        if p.abs().max() == 0:
            torch.nn.init.normal_(p, std=0.1)
    return m.float().eval()


def _wan_like(b, grid, text, gen):
    f, h, w = grid
    return dict(hidden_states=torch.randn(b, 4, f, 2 * h, 2 * w, generator=gen),
                timestep=torch.tensor([500, 300][:b]), encoder_hidden_states=torch.randn(b, text, 16, generator=gen))


def _legacy(name):
    return lambda b, grid, text, gen: _legacy_inputs(name, b, grid, text, gen)


def _ltx2(b, grid, text, gen):
    f, h, w = grid
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    mask = torch.ones(b, text, dtype=torch.long)
    mask[-1, -2:] = 0  # the last sample's text padded
    return dict(hidden_states=r(b, f * h * w, 8), audio_hidden_states=r(b, 5, 8), encoder_hidden_states=r(b, text, 16),
                audio_encoder_hidden_states=r(b, text, 16), timestep=torch.tensor([500, 300][:b]),
                encoder_attention_mask=mask, num_frames=f, height=h, width=w, audio_num_frames=5)


def _minimax(b, grid, text, gen):
    """One packed sequence [text, video, audio] (MiniMax-H3 packs the rows; every batch item shares the layout)."""
    f, h, w = grid
    nv = f * h * w
    # even grids: a packed length of 16k (each rank's blocks of 8k rows: CPU GEMMs over 9 or 10 rows round other
    # than over 18 or 20, 1.8e-7 in both modes, attention not involved); odd grids: an odd length (uneven shards)
    na = ((-(text + nv)) % 16 or 16) if nv % 2 == 0 else 1 + (text + nv) % 2
    s = text + nv + na
    r = lambda *sh: torch.randn(*sh, generator=gen)  # noqa: E731
    pos = torch.zeros(s, 3)
    grid_pos = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    pos[text:text + nv] = grid_pos.reshape(-1, 3).float()
    tags = torch.tensor([1] * text + [0] * nv + [2] * na)
    return dict(hidden_states=r(b, nv, 4 * 4), audio_hidden_states=r(b, na, 8), encoder_hidden_states=r(b, text, 16),
                timestep=torch.tensor([0.5, 0.0]), timestep_indices=(tags == 1).long(), token_tags=tags,
                position_ids=pos, video_indices=torch.arange(text, text + nv), audio_indices=torch.arange(text + nv, s),
                text_indices=torch.arange(text))


_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=H, attention_head_dim=D, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2)

#: class name -> (overrides of its __init__ defaults, inputs(b, grid, text, gen))
TINY = {
    "WanTransformer3DModel": (_WAN, _wan_like),
    "ChronoEditTransformer3DModel": (dict(_WAN, rope_max_seq_len=64), _wan_like),
    "HeliosTransformer3DModel": (dict(_WAN, rope_dim=(2, 2, 4)), _wan_like),
    "FluxTransformer2DModel": (dict(in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=D,
                                    num_attention_heads=H, joint_attention_dim=16, pooled_projection_dim=8,
                                    axes_dims_rope=AX3), _legacy("flux")),
    "Flux2Transformer2DModel": (dict(in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=D,
                                     num_attention_heads=H, joint_attention_dim=16, timestep_guidance_channels=16,
                                     axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False), _legacy("flux2")),
    "QwenImageTransformer2DModel": (dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                         attention_head_dim=D, num_attention_heads=H, joint_attention_dim=16,
                                         axes_dims_rope=AX3), _legacy("qwenimage")),
    "LTXVideoTransformer3DModel": (dict(in_channels=8, out_channels=8, num_attention_heads=H, attention_head_dim=D,
                                        cross_attention_dim=H * D, num_layers=2, caption_channels=16),
                                   _legacy("ltx")),
    "LTX2VideoTransformer3DModel": (dict(in_channels=8, out_channels=8, num_attention_heads=H, attention_head_dim=D,
                                         cross_attention_dim=H * D, audio_in_channels=8, audio_out_channels=8,
                                         audio_num_attention_heads=H, audio_attention_head_dim=D,
                                         audio_cross_attention_dim=H * D, num_layers=2, caption_channels=16),
                                    _ltx2),
    "MiniMaxH3Transformer3DModel": (dict(num_attention_heads=H, attention_head_dim=D, hidden_size=32, num_layers=2,
                                         num_refiner_layers=1, ffn_dim=32, in_channels=4, audio_in_channels=8,
                                         text_dim=16, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=16,
                                         rope_freq_dim=1), _minimax),
}
