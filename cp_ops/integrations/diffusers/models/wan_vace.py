"""Wan VACE (``WanVACETransformer3DModel``): cp_ops's own CP plan (diffusers 0.42 has none).

The VACE blocks run first on the video and control latents (same token count), producing hints added to the main
blocks' hidden states token by token: RoPE rows, the latents at every VACE block and the first main block, and the
control latents at the first VACE block are split (the hints then local); both blocks' ``attn1`` go through cp_ops,
the text cross-attention stays local. Gathered after ``proj_out``.
"""

from __future__ import annotations

from ..plan import Gather, Split


def plan(model) -> list:
    img = ("image",)
    return [
        ("rope", {0: Split(1, img, 4), 1: Split(1, img, 4)}),
        ("", {"timestep": Split(1, img, 2)}),
        ("vace_blocks.0", {"control_hidden_states": Split(1, img, 3)}),
        ("vace_blocks.*", {"hidden_states": Split(1, img, 3)}),
        ("blocks.0", {"hidden_states": Split(1, img, 3)}),
        ("proj_out", Gather(1, "image", 3)),
    ]


ATTENTION = {"blocks.*.attn1": ("image",), "vace_blocks.*.attn1": ("image",)}
