"""Z-Image (``ZImageTransformer2DModel``): cp_ops's own CP plan (diffusers 0.42 has none).

Z-Image refines the image tokens (``noise_refiner``) and the caption tokens (``context_refiner``) apart, then runs
``layers`` over one sequence ``[image, caption]`` per sample (padded, with a key-padding mask). ``noise_refiner``:
image self-attention under CP (stream ``x``; gathered after its last layer: the unified sequence is built from the
full image). ``context_refiner``: local (short). ``layers``: joint attention with the caption sharded with the image
(stream ``unified``, split contiguously, its padding mask a key mask); gathered after the final layer.
"""

from __future__ import annotations

from ..plan import Gather, Split


def plan(model) -> list:
    last = len(model.noise_refiner) - 1
    x, u = ("x",), ("unified",)
    per_layer = lambda s: {"attn_mask": Split(1, s, 2), "freqs_cis": Split(1, s), "noise_mask": Split(1, s, 2)}  # noqa: E731
    return [
        ("noise_refiner.0", {"x": Split(1, x, 3)}),
        ("noise_refiner.*", per_layer(x)),
        (f"noise_refiner.{last}", Gather(1, "x", 3)),
        ("layers.0", {"x": Split(1, u, 3)}),
        ("layers.*", per_layer(u)),
        ("all_final_layer.*", {"noise_mask": Split(1, u, 2)}),
        ("all_final_layer.*", Gather(1, "unified", 3)),
    ]


ATTENTION = {"noise_refiner.*.attention": ("x",), "layers.*.attention": ("unified",)}
