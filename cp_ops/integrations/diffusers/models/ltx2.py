"""LTX-2 (``LTX2VideoTransformer3DModel``): diffusers' ``_cp_plan`` with what it misses, and the attention modules
named.

The video tokens are split (diffusers' plan: ``hidden_states``, the self-attention RoPE ``rope``, the gather at
``proj_out``); the audio tokens and both texts stay whole on every rank (short: cp_ops keeps the video text
replicated, where diffusers' plan splits it, so the text cross-attention stays local). What diffusers' plan misses:
the audio-video cross-attention RoPE of the video side (``cross_attn_rope``), which the split video queries
(``audio_to_video_attn``) and keys (``video_to_audio_attn``) need split alike. Per block:

- ``attn1`` (video self-attention): CP attention over the video stream;
- ``video_to_audio_attn`` (audio queries, whole, against the split video keys): the video K/V (and their mask)
  all-gathered, attended locally (:func:`~cp_ops.integrations.diffusers.generic.call`);
- ``audio_attn1``, ``audio_attn2``, ``attn2``, ``audio_to_video_attn`` (queries against whole keys): local, as on one
  device.
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
