"""parallelize() where a stream is shorter than the CP world size (ranks left with no token of it: empty shards) and
with replicated context (IP-Adapter image tokens every rank holds whole), equal to the unparallelized model on gloo
ranks (W = 2, 3, 4; one rank launch each): Flux, Qwen-Image (text mask) and Z-Image with fewer text and image tokens
than ranks, through AGKV and Ulysses; Flux with IP-Adapter inputs, the IP term attended locally (never through a CP
call); LTX-2 (video and audio); HunyuanVideo's short text refused on every rank with the rule; and cp_ops.attention
itself with empty shards through pipelined AGKV (chunks 2, 4), Ulysses and a 2x2 mesh."""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers_tiny import build, inputs, sample  # noqa: E402
from dist_util import run_ranks  # noqa: E402

MASKED = {"qwenimage", "zimage"}


def _close(out, ref, what):
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-5, (what, rel)  # joint attention sums its keys in another order than one device: rounding


def _modes(w):
    return ("agkv", "ulysses") if 4 % w == 0 else ("agkv",)  # the tiny models have 4 heads


# (model, batch, latent grid (frames, h, w) in tokens, text tokens, masked text) per W: text and image streams
# shorter than W (Z-Image pads its caption to 32 tokens: its image stream is the short one)
SHORT = {
    2: [("flux", 1, (1, 1, 3), 1, False)],
    3: [("flux", 1, (1, 1, 2), 2, False), ("qwenimage", 2, (1, 1, 2), 2, True), ("zimage", 1, (1, 1, 2), 2, False)],
    4: [("flux", 2, (1, 1, 3), 3, False), ("qwenimage", 2, (1, 1, 3), 3, True), ("zimage", 1, (1, 1, 3), 3, False)],
}


def _short_streams(rank, w):
    from cp_ops.integrations.diffusers import parallelize

    for name, b, grid, text, mask in SHORT[w]:
        model = build(name)
        kw = inputs(name, b, grid, text, torch.Generator().manual_seed(w * 10 + text), mask=mask and name in MASKED)
        with torch.no_grad():
            ref = sample(model(**kw))
            for mode in _modes(w):
                cp = parallelize(copy.deepcopy(model), mode=mode, transport="torch")
                _close(sample(cp(**kw)), ref, (name, mode, grid, text))
                if name == "flux":
                    _close(sample(cp(**kw)), ref, (name, mode, grid, text, "again"))  # the model is usable after it


def with_ip_adapter(model, tokens: int = 4):
    """``model`` (a tiny Flux) with one IP-Adapter of ``tokens`` image tokens loaded as diffusers loads one
    (``FluxIPAdapterAttnProcessor`` on the double-stream blocks, an ``ImageProjection``), random seeded weights."""
    from diffusers.models.embeddings import ImageProjection
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    cfg = model.config
    hidden, cross = cfg.num_attention_heads * cfg.attention_head_dim, cfg.joint_attention_dim
    torch.manual_seed(1)
    attn = {}
    for i, _ in enumerate(n for n in model.attn_processors if not n.startswith("single")):
        sd = FluxIPAdapterAttnProcessor(hidden, cross).state_dict()  # to_k_ip.0.weight, ... -> 0.to_k_ip.weight
        attn.update({f"{i}.{k.replace('.0.', '.')}": v for k, v in sd.items()})
    proj = ImageProjection(cross_attention_dim=cross, image_embed_dim=cfg.pooled_projection_dim,
                           num_image_text_embeds=tokens).state_dict()
    image_proj = {"proj.weight": proj["image_embeds.weight"], "proj.bias": proj["image_embeds.bias"],
                  "norm.weight": proj["norm.weight"], "norm.bias": proj["norm.bias"]}
    model._load_ip_adapter_weights({"image_proj": image_proj, "ip_adapter": attn})
    return model


def _ip_adapter(rank, w):
    """Flux with IP-Adapter inputs (diffusers' own test layout: 4 IP tokens, 16 image and 8 text tokens; the issue's
    shapes failed at W = 2, 3 and gathered the IP keys W times at W = 4), and with a text shorter than W: equal to one
    device; one CP call per routed module and forward (the IP term attends locally)."""
    from cp_ops.integrations.diffusers import dispatch, parallelize

    model = with_ip_adapter(build("flux"))
    calls = []
    cp_attention = dispatch.attention

    def counted(*a, **k):
        calls.append(1)
        return cp_attention(*a, **k)

    dispatch.attention = counted
    try:
        for grid, text in (((1, 4, 4), 8), ((1, 2, 3), w - 1)):
            g = torch.Generator().manual_seed(7 + text)
            kw = inputs("flux", 1, grid, text, g)
            emb = torch.randn(1, 1, model.config.pooled_projection_dim, generator=g)
            with torch.no_grad():
                ref = sample(model(**kw, joint_attention_kwargs={"ip_adapter_image_embeds": [emb]}))
                for mode in _modes(w):
                    cp = parallelize(copy.deepcopy(model), mode=mode, transport="torch")
                    calls.clear()
                    out = sample(cp(**kw, joint_attention_kwargs={"ip_adapter_image_embeds": [emb]}))
                    _close(out, ref, ("ip-adapter", mode, grid, text))
                    # one double- and one single-stream block: two CP calls; the IP term none
                    assert len(calls) == 2, (mode, grid, len(calls))
    finally:
        dispatch.attention = cp_attention


def _hunyuan_short_text_refused(rank, w):
    from cp_ops.integrations.diffusers import parallelize

    model = build("hunyuanvideo")
    cp = parallelize(copy.deepcopy(model), mode="agkv", transport="torch")
    kw = inputs("hunyuanvideo", 1, (1, 2, 2), w - 1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"has {w - 1} tokens .* fewer than the CP world size {w}: pass at least "
                                         rf"{w} tokens .*HunyuanVideo's single-stream blocks"):
        with torch.no_grad():
            cp(**kw)


def _attention_empty_shards(rank, w):
    """cp_ops.attention with empty shards through pipelined AGKV (chunks 2, 4) and the 2-D mode (a 2x2 mesh, a whole
    row empty too), against one device."""
    import cp_ops
    from cp_ops import layout
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("agkv", "ulysses"))
    for seq in ((1, 1, 1, 0), (0, 0, 0, 3), (0, 5, 0, 2), (0, 0, 4, 1)):
        g = torch.Generator().manual_seed(sum(seq))
        q, k, v = (torch.randn(1, sum(seq), 4, 8, generator=g) for _ in range(3))
        ref = layout.shard(cp_ops.local_attention(q, k, v), 1, rank, w, seq_lens=seq)
        sh = lambda t: layout.shard(t, 1, rank, w, seq_lens=seq)  # noqa: E731
        for group, mode, chunks in ((None, "agkv", 2), (None, "agkv", 4), (None, "ulysses", 4), (mesh, "auto", 1),
                                    (mesh, "agkv_ulysses", 2)):
            out = cp_ops.attention(sh(q), sh(k), sh(v), group=group, mode=mode, chunks=chunks, seq_lens=seq)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _ltx2(rank, w):
    """LTX-2 (video + audio, its registry line: models/ltx2.py) equal to the unparallelized model: video and audio
    outputs, batch 2 and uneven video, a video stream shorter than W; AGKV and Ulysses."""
    from cp_ops.integrations.diffusers import parallelize
    from cp_plan_tiny import TINY, build as build_class, classes

    name = "LTX2VideoTransformer3DModel"
    overrides, make = TINY[name]
    model = build_class(classes()[name], overrides)
    for mode in _modes(w):
        cp = parallelize(copy.deepcopy(model), mode=mode, transport="torch")
        for b, grid, text in ((2, (1, 3, 3), 7), (1, (1, 1, w - 1), 3)):
            kw = make(b, grid, text, torch.Generator().manual_seed(b * 100 + grid[-1]))
            with torch.no_grad():
                ref, out = model(**kw).to_tuple(), cp(**kw).to_tuple()
            for what, r, o in zip(("video", "audio"), ref, out):
                _close(o, r, ("ltx2", mode, grid, what))


def _compiled_empty_rank(rank, w):
    """The whole parallelized Flux under torch.compile(fullgraph=True, Dynamo only) where a rank holds no text and no
    image token: the mode that takes the empty tensors is traced too; equal to the unparallelized model."""
    from cp_ops.integrations.diffusers import parallelize

    model = build("flux")
    kw = inputs("flux", 1, (1, 1, 3), 3, torch.Generator().manual_seed(5))
    cp = torch.compile(parallelize(copy.deepcopy(model), mode="agkv", transport="torch"), backend="eager",
                       fullgraph=True)
    with torch.no_grad():
        _close(sample(cp(**kw)), sample(model(**kw)), ("flux compiled", rank))


def _all(rank, w):
    _ip_adapter(rank, w)
    _short_streams(rank, w)
    _ltx2(rank, w)
    if w == 4:
        _hunyuan_short_text_refused(rank, w)
        _compiled_empty_rank(rank, w)
        _attention_empty_shards(rank, w)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_short_streams_and_replicated_context(world_size):
    run_ranks(_all, world_size)
