"""HunyuanVideo (``HunyuanVideoTransformer3DModel``): cp_ops's own CP plan (diffusers 0.42 has none).

Joint attention over ``[video, text]`` with the text sharded with the video: the video tokens (and RoPE rows) and the
text tokens (after the token refiner, run whole on every rank) are split at the first double-stream block; the joint
key mask ``[B, 1, 1, N_video + N_text]`` is split stream by stream at every block, each rank keeping ``[its video
block, its text block]``, the order its processors concatenate. Not supported: the image-to-video "token replace"
variant; a text shorter than the CP world size (ValueError).
"""

from __future__ import annotations

from ..plan import Gather, Split

_JOINT = ("image", "text")
#: why every rank needs a text token (Split.every_rank)
_TEXT_EVERY_RANK = ("HunyuanVideo's single-stream blocks cut the text off their sequence by a negative count "
                    "(x[:, :-n_text]), which takes no row at all on a rank holding no text token")


def plan(model) -> list:
    mask = {"attention_mask": Split(3, _JOINT, 4)}
    return [
        ("rope", {0: Split(0, ("image",), 2), 1: Split(0, ("image",), 2)}),
        ("transformer_blocks.0", {"hidden_states": Split(1, ("image",), 3),
                                  "encoder_hidden_states": Split(1, ("text",), 3, _TEXT_EVERY_RANK)}),
        ("transformer_blocks.*", mask),
        ("single_transformer_blocks.*", mask),
        ("proj_out", Gather(1, "image", 3)),
    ]


ATTENTION = {"transformer_blocks.*.attn": _JOINT, "single_transformer_blocks.*.attn": _JOINT}


def check(model) -> None:
    if model.config.image_condition_type == "token_replace":
        raise ValueError("cp_ops.parallelize: HunyuanVideo with image_condition_type='token_replace' is not supported "
                         "(its first-frame modulation indexes the full token sequence)")
