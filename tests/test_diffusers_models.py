"""parallelize() on tiny diffusers transformers of every supported class equals the unparallelized model
(gloo, W = 2, 3, 4): divisible and indivisible token counts, batch 2, text masks, CFG lanes, one dynamic compile.
Marked gpu (skipped without 2 GPUs): the same on NCCL, one GPU a rank, and no host sync."""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers_tiny import build, inputs, sample  # noqa: E402
from dist_util import run_ranks  # noqa: E402
from row_exact import assert_same  # noqa: E402

# models whose CP attention sees the same keys in the same order as one device: bitwise equal on CPU (where its
# matmul is row-exact: tests/row_exact.py)
SAME_ORDER = {"wan", "wan_vace", "ltx"}
JOINT = {"flux", "flux2", "qwenimage", "zimage", "hunyuanvideo"}
MASKED = {"qwenimage", "zimage", "hunyuanvideo"}  # models that take a text key-padding mask
ALL = sorted(SAME_ORDER | JOINT)


def _compare(name, out, ref, what, exact=True):
    assert out.shape == ref.shape, (name, what, out.shape, ref.shape)
    if name in SAME_ORDER and exact:  # bitwise where this CPU's matmul is row-exact (tests/row_exact.py)
        assert_same(out, ref, (name, what))
    else:  # joint attention sees its keys as [text_0, image_0, text_1, image_1, ...]: equal to rounding
        rel = ((out - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-5, (name, what, rel)


def _run(name, cases, w):
    from cp_ops.integrations.diffusers import parallelize

    model = build(name)
    cp = {}
    for mode, b, size, text, mask in cases:
        if mode not in cp:
            cp[mode] = parallelize(copy.deepcopy(model), mode=mode, transport="torch")
        g = torch.Generator().manual_seed(hash((b, size, text)) % 1000)
        kw = inputs(name, b, size, text, g, mask=mask and name in MASKED)
        with torch.no_grad():
            ref = sample(model(**kw))
            out = sample(cp[mode](**kw))
        # bitwise on W = 2, 4 with even shards; uneven shards or W = 3: each rank's query block has a length whose
        # CPU SDPA reduction differs from one device's (measured: ≤ 2.4e-7 absolute)
        even = (size[0] * size[1] * size[2]) % w == 0 and w in (2, 4)
        _compare(name, out, ref, (w, mode, b, size, text, mask), exact=even)


# (mode, batch, (frames, h, w) latent grid in tokens, text tokens, masked text)
CASES = {
    # 8 / 16 image tokens, 8 text tokens (Z-Image: 64 / 96 unified); 9 / 18 image and 7 text tokens
    2: [("ulysses", 1, (2, 2, 2), 8, False), ("ulysses", 2, (1, 2, 4), 8, True), ("agkv", 2, (1, 3, 3), 7, True)],
    3: [("auto", 2, (1, 3, 3), 7, True)],  # AGKV (W does not divide the 4 heads); Z-Image refiner: 32 tokens
    # 9 image tokens on 4 ranks, through Ulysses (tensor_split's split: the prefix one would leave rank 3 empty);
    # 10 through AGKV: the prefix split (3, 3, 3, 1), the final gather taking the first 10 of the 12 padded rows
    4: [("ulysses", 2, (1, 3, 3), 7, True), ("agkv", 1, (1, 2, 5), 7, False)],
}


def _models_equal(rank, w, names):
    for name in names:
        _run(name, CASES[w], w)
    if w == 2:
        _wan22_per_token_timestep(rank, w)
        # modes by name: 'auto' is AGKV at W = 2 since session 6, and Ulysses was what these exercised before it
        _compile_three_resolutions(rank, w, "flux", "ulysses")  # (AGKV too: +12 s of CI on 2 cores)
        for mode in ("agkv", "ulysses"):
            _no_host_sync(rank, w, ["flux", "qwenimage", "zimage", "hunyuanvideo"], mode)
        _dynamic_last_rank_one_token(rank, w)
    if w == 4:
        _cfg_lanes(rank, w, ["wan", "flux", "zimage"])


def _dynamic_last_rank_one_token(rank, w):
    """Qwen-Image (text mask) compiled with dynamic shapes where the prefix split leaves the last rank one image and
    one text token ((1, 1, 3) = 3 image tokens, 3 text tokens on 2 ranks: (2, 1) each; first seen at W = 4, 10 and
    10 tokens as (3, 3, 3, 1)): the key mask's check compared Dynamo's specialized size with the symbolic count
    equal to it and raised on the last rank only; equal to the unparallelized model. One layer: the check runs in
    every layer's attention alike, and each further layer only adds to the dynamic trace."""
    from cp_ops.integrations.diffusers import parallelize

    model = build("qwenimage", num_layers=1)
    compiled = torch.compile(parallelize(copy.deepcopy(model), mode="agkv", transport="torch"), backend="eager",
                             dynamic=True, fullgraph=True)
    kw = inputs("qwenimage", 2, (1, 1, 3), 3, torch.Generator().manual_seed(1), mask=True)
    with torch.no_grad():
        _compare("qwenimage", sample(compiled(**kw)), sample(model(**kw)), (w, "dynamic, last rank 1 token"))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_models_equal_unparallelized(world_size):
    """Every supported model at W = 2, 3, 4 (W=2 also: one dynamic compile for many resolutions, no host reads of
    tensor values in a forward, a dynamic compile whose last rank holds one token; W=4 also: CFG lanes)."""
    run_ranks(_models_equal, world_size, ALL)


def _cfg_lanes(rank, w, names):
    """4 ranks = 2 CFG lanes × CP2: the batch of 2 [cond, uncond] split by lane, equal to the one-device batch."""
    from cp_ops.integrations.diffusers import parallelize

    for name in names:
        model = build(name)
        cp_model = parallelize(copy.deepcopy(model), mode="auto", transport="torch", cfg_parallel=True)
        assert cp_model._cp_ops_group.size() == w // 2
        g = torch.Generator().manual_seed(3)
        kw = inputs(name, 2, (1, 2, 4), 8, g)
        with torch.no_grad():
            ref = sample(model(**kw))
            out = sample(cp_model(**kw))
        # each lane runs batch 1 where the reference ran batch 2: equal to rounding
        rel = ((out - ref).abs().max() / ref.abs().max()).item()
        assert out.shape == ref.shape and rel <= 1e-5, (name, rel)
        with pytest.raises(ValueError, match="cfg_parallel=True takes a batch of 2"):
            with torch.no_grad():
                cp_model(**inputs(name, 1, (1, 2, 4), 8, g))


def _wan22_per_token_timestep(rank, w):
    """Wan 2.2 TI2V passes one timestep per token ([B, S]); the class plan splits it with the tokens."""
    from cp_ops.integrations.diffusers import parallelize

    model = build("wan")
    cp_model = parallelize(copy.deepcopy(model), mode="agkv", transport="torch")
    g = torch.Generator().manual_seed(6)
    for size in [(1, 2, 4), (1, 3, 3)]:  # 8 and 9 tokens
        kw = inputs("wan", 2, size, 7, g)
        kw["timestep"] = torch.randint(0, 1000, (2, size[0] * size[1] * size[2]), generator=g)
        with torch.no_grad():
            ref = sample(model(**kw))
            out = sample(cp_model(**kw))
        _compare("wan", out, ref, ("per-token timestep", size), exact=size == (1, 2, 4))


def _compile_three_resolutions(rank, w, name, mode):
    """One model compiled once (dynamic shapes, fullgraph: no graph break) serves three resolutions from one graph;
    an image token count W does not divide adds one graph (the uneven gather), not one per shape."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from cp_ops.integrations.diffusers import parallelize

    model = build(name)
    cp_model = parallelize(copy.deepcopy(model), mode=mode, transport="torch")
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(cp_model, backend=counter, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(4)
    # sizes > 1 and unequal to the model's fixed dims (dynamic=True specializes 0/1 sizes, and a size equal to a
    # weight's dim becomes that constant); 7 text tokens (uneven on W=2 throughout)
    for size, graphs in [((1, 3, 4), 1), ((1, 5, 6), 1), ((1, 4, 7), 1), ((1, 3, 5), 2), ((1, 5, 7), 2)]:
        kw = inputs(name, 1, size, 7, g)
        with torch.no_grad():
            ref = sample(model(**kw))
            out = sample(compiled(**kw))
        _compare(name, out, ref, ("compiled", mode, size), exact=False)
        assert counter.frame_count == graphs, (mode, size, f"{counter.frame_count} graphs, expected {graphs}")



def _no_host_sync(rank, w, names, mode):
    """After the first forward of a shape (the once-per-shape input checksum), a parallelized model's forward reads
    no tensor value on the host: Tensor.item/tolist/__bool__/__int__/__float__/numpy raise during it (on CUDA each
    would be a device synchronisation per layer)."""
    from cp_ops.integrations.diffusers import parallelize

    reads = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy")
    for name in names:
        cp_model = parallelize(build(name), mode=mode, transport="torch")
        g = torch.Generator().manual_seed(5)
        kw = inputs(name, 2, (1, 3, 3), 7, g)  # uneven shards: the seq_lens path too
        with torch.no_grad():
            cp_model(**kw)  # first call of this shape: the input checksum reads values, once
            saved = {r: getattr(torch.Tensor, r) for r in reads}

            def refuse(r):
                def f(self, *a, **k):
                    raise AssertionError(f"host read Tensor.{r} during a parallelized forward")
                return f

            try:
                for r in reads:
                    setattr(torch.Tensor, r, refuse(r))
                for read in (lambda: torch.ones(1).item(), lambda: bool(torch.ones(1)), lambda: int(torch.ones(1))):
                    with pytest.raises(AssertionError, match="host read"):  # the trap works
                        read()
                cp_model(**kw)
            finally:
                for r, f in saved.items():
                    setattr(torch.Tensor, r, f)


# ---- GPU (diffusers models on NCCL; marked gpu, skipped without the GPUs; formerly tests/test_diffusers_gpu.py) ----
# GPU (NCCL, 2 GPUs): every supported tiny diffusers model parallelized equals one GPU, and its forward makes no
# device synchronisation that the unparallelized model does not make (torch.cuda.set_sync_debug_mode('error')).
pytest.importorskip("diffusers")


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

NAMES = ["wan", "wan_vace", "ltx", "flux", "flux2", "qwenimage", "zimage", "hunyuanvideo"]


def _to(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, list):
        return [_to(v, dev) for v in x]
    return x


def _syncs(fn) -> str | None:
    """None if ``fn()`` makes no synchronising CUDA call, else the error's first line."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _cuda_models(rank, w):
    from cp_ops.integrations.diffusers import parallelize

    dev = torch.device("cuda", rank)
    for name in NAMES:
        model = build(name).to(dev)
        cp_model = parallelize(copy.deepcopy(model), mode="auto", transport="auto")
        g = torch.Generator().manual_seed(7)
        kw = {k: _to(v, dev) for k, v in inputs(name, 2, (2, 3, 3), 7, g, mask=True).items()}
        with torch.no_grad():
            ref = sample(model(**kw))
            out = sample(cp_model(**kw))  # first call of this shape: the input checksum syncs, once
            rel = ((out - ref).abs().max() / ref.abs().max()).item()
            assert rel <= 1e-4, (name, rel)  # TF32/cuDNN kernels on other query blocks: equal to rounding
            model_syncs = _syncs(lambda: model(**kw))
            if model_syncs is None:  # the model's own code makes no sync: the parallelized one must not either
                cp_syncs = _syncs(lambda: cp_model(**kw))
                assert cp_syncs is None, (name, cp_syncs)
            elif rank == 0:
                print(f"{name}: the unparallelized model itself synchronises ({model_syncs}); not compared")


@pytest.mark.gpu
@TWO_GPUS
def test_cuda_models_equal_and_no_sync():
    run_ranks(_cuda_models, 2, device="cuda")
