"""The key mask once per forward (issue 21 item 4): a parallelized model whose blocks take a key-padding mask input
builds the every-key mask ``[B, S_total]`` once per forward (CPState.note_key_mask) and every attention call uses it
instead of gathering its own mask. On 2 gloo ranks: equal to the unparallelized model for Qwen-Image, Z-Image and
HunyuanVideo (Ulysses and AGKV, uneven shards, batch 2), no per-call mask gather, right again after the mask changes
(a new tensor, and the same tensor changed in place), the same under regional compilation (Dynamo + AOTAutograd,
one graph per block class across masks); a processor whose mask differs from the input's block stops (device check).
"""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers_tiny import build, inputs, sample  # noqa: E402
from dist_util import run_ranks  # noqa: E402


def _rel(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _gathers(monkeypatch_store):
    """Count the per-call mask gathers (Shards.pad_mask: only the gathering path pads this rank's mask)."""
    from cp_ops import layout

    orig = layout.Shards.pad_mask
    calls = []

    def pad_mask(self, key_mask):
        calls.append(tuple(key_mask.shape))
        return orig(self, key_mask)

    layout.Shards.pad_mask = pad_mask
    monkeypatch_store.append(lambda: setattr(layout.Shards, "pad_mask", orig))
    return calls


def _shared(rank, w):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from cp_ops.integrations.diffusers import hooks, parallelize
    from cp_ops.integrations.diffusers.compiled import _canonical_strides, repeated_blocks

    undo = []
    gathers = _gathers(undo)
    try:
        for name, mode in (("qwenimage", "ulysses"), ("zimage", "agkv"), ("hunyuanvideo", "ulysses")):
            model = build(name)
            cp = parallelize(copy.deepcopy(model), mode=mode, transport="torch")
            g = torch.Generator().manual_seed(7)
            kw = inputs(name, 2, (1, 3, 3), 7, g, mask=True)  # 9 image tokens, 7 text tokens: uneven on W = 2
            gathers.clear()
            with torch.no_grad():
                ref, out = sample(model(**kw)), sample(cp(**kw))
            assert _rel(out, ref) <= 1e-5, (name, _rel(out, ref))
            assert cp._cp_ops_state.key_masks, name  # the forward's every-key mask was built ...
            assert gathers == [], (name, gathers)  # ... and no call gathered its own
            bufs = {k: t.data_ptr() for k, t in cp._cp_ops_state._mask_bufs.items()}
            with torch.no_grad():  # a second forward: its masks (new tensors) in the same buffers (CUDA graphs)
                out2 = sample(cp(**kw))
            assert torch.equal(out2, out) and bufs == {k: t.data_ptr() for k, t in cp._cp_ops_state._mask_bufs.items()}
            if name != "qwenimage":
                continue
            # the mask changes between forwards: a new tensor, then the same tensor changed in place
            m = kw["encoder_hidden_states_mask"]
            for change in ("new", "in place"):
                if change == "new":
                    m = m.clone()
                    m[0, 1:4] = False
                    kw["encoder_hidden_states_mask"] = m
                else:
                    m[1, :] = True
                    m[1, 2] = False
                with torch.no_grad():
                    ref2, out2 = sample(model(**kw)), sample(cp(**kw))
                assert not torch.equal(ref2, ref)
                assert _rel(out2, ref2) <= 1e-5, (change, _rel(out2, ref2))
                ref = ref2
            # regional compilation (as compile_blocks, traced by Dynamo + AOTAutograd): the every-key mask is a
            # graph input, one graph per block class whatever the mask
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("aot_eager")
            for block in repeated_blocks(cp):
                block.forward = torch.compile(block.forward, backend=counter, fullgraph=True, dynamic=False)
                block.register_forward_pre_hook(_canonical_strides, with_kwargs=True)
            ptrs = set()
            for step in range(2):
                m = m.clone()
                m[step, 5:] = False
                kw["encoder_hidden_states_mask"] = m
                with torch.no_grad():
                    ref3, out3 = sample(model(**kw)), sample(cp(**kw))
                assert _rel(out3, ref3) <= 1e-5, (step, _rel(out3, ref3))
                ptrs |= {t.data_ptr() for t in cp._cp_ops_state.key_masks.values()}
            assert counter.frame_count == 1, counter.frame_count
            assert len(ptrs) == 1, ptrs  # new values in the same buffer: a CUDA graph reads them in place
            assert gathers == []
            # a processor whose mask is not the input's block: the device check stops it (CPU: raises at once)
            orig = hooks._every_key

            def wrong(full, spec, state, streams, into=None):
                out = orig(full, spec, state, streams)
                return None if out is None else ~out

            hooks._every_key = wrong
            try:
                kw["encoder_hidden_states_mask"] = m.clone()
                with pytest.raises(RuntimeError, match="differs from this rank's block of the forward's mask input"):
                    with torch.no_grad():
                        cp(**kw)
            finally:
                hooks._every_key = orig
            torch._dynamo.reset()
    finally:
        for f in reversed(undo):
            f()


def test_key_mask_once_per_forward():
    run_ranks(_shared, 2)


def _inference_mode(rank, w):
    from cp_ops.integrations.diffusers import parallelize

    model = build("qwenimage")
    cp = parallelize(copy.deepcopy(model), mode="ulysses", transport="torch")
    g = torch.Generator().manual_seed(8)
    kw = inputs("qwenimage", 2, (1, 3, 3), 7, g, mask=True)
    with torch.inference_mode():  # masks made here are inference tensors: no version counter
        m = kw["encoder_hidden_states_mask"] = kw["encoder_hidden_states_mask"].clone()
        ref, out = sample(model(**kw)), sample(cp(**kw))
        assert _rel(out, ref) <= 1e-5, _rel(out, ref)
        m[0, 2:5] = False  # the same tensor changed in place: rebuilt (no version to compare)
        ref2, out2 = sample(model(**kw)), sample(cp(**kw))
        assert not torch.equal(ref2, ref) and _rel(out2, ref2) <= 1e-5, _rel(out2, ref2)
    kw["encoder_hidden_states_mask"] = torch.rand(2, 7, generator=g) > 0.3  # then outside inference mode
    with torch.no_grad():
        ref3, out3 = sample(model(**kw)), sample(cp(**kw))
    assert _rel(out3, ref3) <= 1e-5, _rel(out3, ref3)


def test_key_mask_under_inference_mode():
    """Under torch.inference_mode (masks without a version counter; was: RuntimeError 'Inference tensors do not
    track version counter' at the first forward): equal to the model, also after the mask changes in place, and in
    a later forward outside inference mode (whose mask buffer was made inside it)."""
    run_ranks(_inference_mode, 2)


def _alternating_lengths(rank, w):
    from cp_ops.integrations.diffusers import parallelize

    model = build("qwenimage")
    cp = parallelize(copy.deepcopy(model), mode="ulysses", transport="torch")
    g = torch.Generator().manual_seed(9)
    ptrs = {}
    for step, text in enumerate((7, 5, 7, 5)):  # CFG: the prompt's and the negative prompt's lengths, alternating
        kw = inputs("qwenimage", 1, (1, 3, 3), text, g)
        kw["encoder_hidden_states_mask"] = torch.rand(1, text, generator=g) > 0.3
        with torch.no_grad():
            ref, out = sample(model(**kw)), sample(cp(**kw))
        assert _rel(out, ref) <= 1e-5, (step, _rel(out, ref))
        (every,) = cp._cp_ops_state.key_masks.values()
        ptrs.setdefault(text, set()).add(every.data_ptr())
    assert all(len(p) == 1 for p in ptrs.values()), ptrs  # each shape's mask keeps its address (CUDA graphs)


def test_key_mask_alternating_shapes_keep_their_buffers():
    """Forwards alternating between masks of two shapes (CFG's prompt and negative prompt of different lengths): each
    equal to the model, and each shape's every-key mask written into the same buffer every time (was: one buffer per
    attention's streams, replaced at every change of shape: a new address each forward, so the compiled blocks'
    CUDA graphs recorded again every forward)."""
    run_ranks(_alternating_lengths, 2)
