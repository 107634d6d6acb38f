"""parallelize() on tiny diffusers transformers of every supported class equals the unparallelized model
(gloo, W = 2, 3, 4): divisible and indivisible token counts, batch 2, text masks, CFG lanes, one dynamic compile."""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers_tiny import build, inputs, sample  # noqa: E402
from dist_util import run_ranks  # noqa: E402

# models whose CP attention sees the same keys in the same order as one device: bitwise equal on CPU
SAME_ORDER = {"wan", "wan_vace", "ltx"}
JOINT = {"flux", "flux2", "qwenimage", "zimage", "hunyuanvideo"}
MASKED = {"qwenimage", "zimage", "hunyuanvideo"}  # models that take a text key-padding mask
ALL = sorted(SAME_ORDER | JOINT)


def _compare(name, out, ref, what):
    assert out.shape == ref.shape, (name, what, out.shape, ref.shape)
    if name in SAME_ORDER:
        assert torch.equal(out, ref), (name, what, (out - ref).abs().max().item())
    else:  # joint attention sees its keys as [text_0, image_0, text_1, image_1, ...]: equal to rounding
        rel = ((out - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-5, (name, what, rel)


def _run(name, cases, w, mode):
    from cp_ops.integrations.diffusers import parallelize

    model = build(name)
    cp_model = parallelize(copy.deepcopy(model), mode=mode, transport="torch")
    for b, size, text, mask in cases:
        g = torch.Generator().manual_seed(hash((b, size, text)) % 1000)
        kw = inputs(name, b, size, text, g, mask=mask and name in MASKED)
        with torch.no_grad():
            ref = sample(model(**kw))
            out = sample(cp_model(**kw))
        _compare(name, out, ref, (w, mode, b, size, text, mask))


# (batch, (frames, h, w) latent grid in tokens, text tokens, masked text)
DIVISIBLE = [(1, (2, 2, 2), 8, False), (2, (1, 2, 4), 8, True)]
INDIVISIBLE = [(2, (1, 3, 3), 7, True)]  # 9 (or 18) image tokens, 7 text tokens


def _models_equal(rank, w, names, cases):
    for name in names:
        _run(name, cases, w, "auto")


@pytest.mark.parametrize("world_size", [2, 4])
def test_models_divisible(world_size):
    run_ranks(_models_equal, world_size, ALL, DIVISIBLE)
