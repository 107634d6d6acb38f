"""LTX-2 (``LTX2VideoTransformer3DModel``): diffusers' ``_cp_plan`` with what it misses, and the attention modules.

The video tokens are split (diffusers' plan); the audio tokens and both texts stay whole on every rank (cp_ops keeps
the video text replicated, so the text cross-attention stays local). Added: the video side's audio-video
cross-attention RoPE (``cross_attn_rope``), split like the video queries and keys it meets. Per block: ``attn1``
(video self-attention) is CP attention; ``video_to_audio_attn`` (whole audio queries, split video keys) all-gathers
the video K/V and attends locally (:func:`~cp_ops.integrations.diffusers.generic.call`); the other attentions
(queries against whole keys) are local, as on one device.
"""

from __future__ import annotations

from .. import _private
from ..plan import Split, from_diffusers


def plan(model) -> list:
    out = from_diffusers(type(model), drop={("", "encoder_hidden_states"), ("", "encoder_attention_mask")})
    if _private.class_cp_plan(type(model)).get("cross_attn_rope") is None:  # a later diffusers may add it
        out.append(("cross_attn_rope", {0: Split(1, ("image",), 3), 1: Split(1, ("image",), 3)}))
    return out


#: () = the streams found per call: cross-attention to the split video (generic.call)
ATTENTION = {"transformer_blocks.*.attn1": ("image",), "transformer_blocks.*.video_to_audio_attn": ()}
