"""Z-Image (``ZImageTransformer2DModel``): cp_ops's own CP plan (diffusers 0.42 has none).

Z-Image refines the image tokens (``noise_refiner``) and the caption tokens (``context_refiner``) separately, then
runs its main ``layers`` over one unified sequence ``[image, caption]`` per sample (each part padded to a multiple
of 32 with learned pad tokens; samples of different lengths padded at the end and masked with a key-padding mask).

- ``noise_refiner``: image self-attention under CP (stream ``x``: its inputs split at the first layer, the mask and
  RoPE at every layer; the output all-gathered after the last layer, since the unified sequence is built from the
  full image tokens).
- ``context_refiner``: caption self-attention, local (the caption is short; every rank runs it on the full caption).
- ``layers``: joint attention with the caption *sharded with the image*: the unified sequence (stream ``unified``)
  is split contiguously, so each token sits on exactly one rank and is counted once in the softmax; the batch
  padding mask is split with it and passed to :func:`cp_ops.attention` as a key mask. Gathered after the final
  layer.
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
