"""The diffusers transformer classes :func:`~cp_ops.integrations.diffusers.parallelize` supports, and how: where the
CP plan comes from (the class's ``_cp_plan`` with its text inputs named, or an adapter in :mod:`.models`), which
attention modules go through cp_ops over which token streams (``("text", "image")``: joint attention, the text
sharded with the image), and the inputs the model-level rank check compares. A class with a ``_cp_plan`` and no
line runs through :mod:`.generic`. Adding a model: one :class:`ModelSpec` line (or an adapter in ``models/``) and a
tiny-config test in ``tests/test_diffusers_models.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import _private, generic
from .models import hunyuan_video, ltx2, wan_vace, zimage
from .plan import Plan, from_diffusers


@dataclass(frozen=True)
class ModelSpec:
    plan: Callable[[object], Plan]
    attention: dict[str, tuple[str, ...]]
    checked_inputs: tuple[str, ...] = ("hidden_states", "timestep", "encoder_hidden_states")
    check: Callable[[object], None] | None = None
    plan_source: str = "diffusers _cp_plan"


def _diffusers(text=(), drop=()):
    return lambda model: from_diffusers(type(model), set(text), set(drop))


_JOINT = ("text", "image")

SUPPORTED: dict[str, ModelSpec] = {
    "WanTransformer3DModel": ModelSpec(plan=_diffusers(), attention={"blocks.*.attn1": ("image",)}),
    "WanVACETransformer3DModel": ModelSpec(
        plan=wan_vace.plan, attention=wan_vace.ATTENTION, plan_source="cp_ops (models/wan_vace.py)"),
    "FluxTransformer2DModel": ModelSpec(
        plan=_diffusers(text={("", "encoder_hidden_states"), ("", "txt_ids")}),
        attention={"transformer_blocks.*.attn": _JOINT, "single_transformer_blocks.*.attn": _JOINT}),
    "Flux2Transformer2DModel": ModelSpec(
        plan=_diffusers(text={("", "encoder_hidden_states"), ("", "txt_ids")}),
        attention={"transformer_blocks.*.attn": _JOINT, "single_transformer_blocks.*.attn": _JOINT}),
    "QwenImageTransformer2DModel": ModelSpec(
        plan=_diffusers(text={("transformer_blocks.0", "encoder_hidden_states"),
                              ("transformer_blocks.*", "encoder_hidden_states_mask"), ("pos_embed", 1)}),
        attention={"transformer_blocks.*.attn": _JOINT}),
    "LTXVideoTransformer3DModel": ModelSpec(
        # the class plan also splits the text (its cross-attention then gathers it back); cp_ops keeps the text
        # replicated so cross-attention stays local
        plan=_diffusers(drop={("", "encoder_hidden_states"), ("", "encoder_attention_mask")}),
        attention={"transformer_blocks.*.attn1": ("image",)}),
    "LTX2VideoTransformer3DModel": ModelSpec(
        plan=ltx2.plan, attention=ltx2.ATTENTION, plan_source="diffusers _cp_plan + cp_ops (models/ltx2.py)"),
    "ZImageTransformer2DModel": ModelSpec(
        plan=zimage.plan, attention=zimage.ATTENTION, checked_inputs=("x", "t", "cap_feats"),
        plan_source="cp_ops (models/zimage.py)"),
    "HunyuanVideoTransformer3DModel": ModelSpec(
        plan=hunyuan_video.plan, attention=hunyuan_video.ATTENTION, check=hunyuan_video.check,
        plan_source="cp_ops (models/hunyuan_video.py)"),
}


def spec_for(model) -> ModelSpec:
    """The :class:`ModelSpec` of ``model``'s class: its line in :data:`SUPPORTED`, else for a class with a diffusers
    ``_cp_plan`` the generic installer's. ValueError for another class, listing the supported ones and how to add one.
    """
    name = type(model).__name__
    if name not in SUPPORTED and _private.class_cp_plan(type(model)):
        return ModelSpec(plan=generic.plan, attention=generic.attention(model),
                         plan_source="diffusers _cp_plan (generic installer, generic.py)")
    if name not in SUPPORTED:
        raise ValueError(
            f"cp_ops.parallelize supports {tuple(SUPPORTED)}; got {name}. To add a model: one ModelSpec line in "
            "cp_ops/integrations/diffusers/registry.py (its diffusers _cp_plan with the text inputs named, or an "
            "adapter in cp_ops/integrations/diffusers/models/ giving plan(model) and the attention modules); a class "
            "with a diffusers _cp_plan needs none (the generic installer takes it)")
    return SUPPORTED[name]
