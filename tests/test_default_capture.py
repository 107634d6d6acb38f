"""parallelize's default ``cuda_graphs="auto"``: the whole forward captured where it can be, else eager with one
warning naming why — never an error, never numbers other than eager's. On the CPU nothing changes (no capture, no
warning). The capture itself is cp_ops.captured's CPU stand-in (tests/test_captured.py's Recorder: keys, static
inputs, clones, the ranks' agreement run for real); the GPU side is tests/test_default_capture_gpu.py."""

import copy
import datetime
import socket
import warnings

import pytest
import torch

pytest.importorskip("diffusers")

from dist_util import run_ranks  # noqa: E402
from test_captured import Recorder  # noqa: E402

from cp_ops import captured  # noqa: E402


def _one_rank_group(backend: str):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if backend == "fake":
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))


def test_the_decision(monkeypatch):
    """CPU: eager, no warning. Where a capture can run (the stand-in): captured, the fallback armed, no warning.
    Ranks sharing a GPU over gloo with the torch transport: eager, one warning naming why; transport='fast' there
    is captured. cuda_graphs=False: eager, no warning."""
    import torch.distributed as dist

    from cp_ops.integrations.diffusers import install, parallelize
    from diffusers_tiny import build

    _one_rank_group("gloo")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model = parallelize(build("wan"), mode="agkv", transport="torch", chunks=1)
            assert captured.captured(model) is None  # the CPU: unchanged
            monkeypatch.setattr(captured, "BACKEND", Recorder())
            model = parallelize(build("wan"), mode="agkv", transport="torch", chunks=1)
            cf = captured.captured(model)
            assert cf is not None and cf.fallback is not None and cf.eager_why is None
            assert captured.captured(parallelize(build("wan"), mode="agkv", transport="torch", chunks=1,
                                                 cuda_graphs=False)) is None
        # a model on CUDA whose group moves CUDA tensors over gloo (ranks sharing one GPU)
        monkeypatch.setattr(captured, "_device_of", lambda m: torch.device("cuda", 0))
        assert install.auto_graphs(build("wan"), "fast", dist.group.WORLD) == ("forward", None)
        with pytest.warns(UserWarning, match=r"cp_ops.parallelize: WanTransformer3DModel runs eager, its whole forward "
                                             r"not captured in one CUDA graph \(the default on CUDA\): its ranks share "
                                             r"a GPU over gloo.*transport='fast' can be captured.*cuda_graphs=False"):
            model = parallelize(build("wan"), mode="agkv", transport="torch", chunks=1)
        assert captured.captured(model) is None
    finally:
        dist.destroy_process_group()


def _fallbacks(rank, w):
    """2 gloo ranks, the stand-in capture: the default captures and equals eager bitwise; a failing capture (one
    rank's), a step cache enabled before parallelize or after a capture, outputs a replay cannot return: each gives
    one warning and eager numbers, bitwise; a forward that fails on its inputs raises its own error and leaves the
    capture on; a call traced by torch.compile runs the eager forward."""
    from diffusers import FirstBlockCacheConfig

    from cp_ops.integrations.diffusers import parallelize
    from diffusers_tiny import build, inputs, sample

    base = build("wan")
    eager = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, cuda_graphs=False)
    g = torch.Generator().manual_seed(5)
    kws = [inputs("wan", 1, (2, 4, 4), 6, g) for _ in range(3)]
    with torch.no_grad():
        refs = [sample(eager(**kw)) for kw in kws]

    def run(model, n=3):
        with torch.no_grad(), model.cache_context("cond"):  # a step cache's state is kept per context
            return [sample(model(**kw)) for kw in kws[:n]]

    def same(outs, want):
        assert all(torch.equal(o, r) for o, r in zip(outs, want)), [(o - r).abs().max().item()
                                                                    for o, r in zip(outs, want)]

    captured.BACKEND = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1)
        same(run(model), refs)
    cf = captured.captured(model)
    assert cf.captures == 1 and cf.eager_why is None and captured.BACKEND.events.count("replay") == 3

    # one rank's capture fails: every rank warns (rank 1's reason) and runs eager from then on
    captured.BACKEND = Recorder(fail=RuntimeError("operation not permitted when stream is capturing")
                                if rank == 1 else None)
    model = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1)
    with pytest.warns(UserWarning, match=r"WanTransformer3DModel runs eager.*failed on rank\(s\) \[1\]; rank 1's "
                                         r"reason: capture: RuntimeError: operation not permitted"):
        outs = run(model, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # told once
        outs += run(model)[1:]
    same(outs, refs)
    assert captured.captured(model).eager_why is not None and captured.BACKEND.events.count("capture") == 1

    # a step cache: enabled before parallelize (refused at the first call), or after a capture (the graphs dropped)
    cache = FirstBlockCacheConfig(threshold=0.05)
    want = copy.deepcopy(base)
    want.enable_cache(cache)
    want = parallelize(want, mode="agkv", transport="torch", chunks=1, cuda_graphs=False)
    want_outs = run(want)
    captured.BACKEND = Recorder()
    before = copy.deepcopy(base)
    before.enable_cache(cache)
    before = parallelize(before, mode="agkv", transport="torch", chunks=1)
    with pytest.warns(UserWarning, match=r"runs eager.*a step cache \(FBCHeadBlockHook\) acts on the host at each "
                                         r"call, which a CUDA graph cannot replay"):
        same(run(before), want_outs)
    assert "capture" not in captured.BACKEND.events  # refused before any warm-up: the cache's state is eager's
    after = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1)
    same(run(after, 1), refs)
    assert captured.captured(after).captures == 1
    with pytest.warns(UserWarning, match=r"runs eager.*FBCHeadBlockHook"):
        after.enable_cache(cache)
    want = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, cuda_graphs=False)
    want.enable_cache(cache)
    same(run(after), run(want))

    # a forward that fails on its inputs: its own error (not a capture error), the capture still on
    model = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1)
    bad = dict(kws[0], hidden_states=kws[0]["hidden_states"][:, :3])
    with pytest.raises(RuntimeError) as info, torch.no_grad():
        model(**bad)
    assert not isinstance(info.value, captured.CaptureError), info.value
    assert captured.captured(model).eager_why is None
    same(run(model), refs)

    # traced by torch.compile: the eager forward is what it compiles
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same(run(compiled, 1), refs)
    assert captured.captured(model).eager_why is None


def test_fallbacks_give_eager_numbers():
    run_ranks(_fallbacks, 2)


def test_host_hooks_named():
    """What the default refuses to capture, by name: a step cache, accelerate's offloading hook, LoRA layers (peft);
    layerwise casting is replayed as recorded."""
    from diffusers import FirstBlockCacheConfig

    from cp_ops.integrations.diffusers.caches import host_hooks
    from diffusers_tiny import build

    model = build("wan")
    assert host_hooks(model) is None
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert host_hooks(model) is None
    cached = build("wan")
    cached.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    assert host_hooks(cached).startswith("a step cache (FBCHeadBlockHook) acts on the host at each call")
    offloaded = build("wan")
    offloaded.blocks[0]._hf_hook = object()  # what accelerate's add_hook_to_module sets
    assert host_hooks(offloaded).startswith("accelerate moves its weights at each call")
    lora = build("wan")
    layer = type("Linear", (torch.nn.Module,), {"__module__": "peft.tuners.lora.layer"})()
    lora.blocks[0].add_module("lora", layer)
    assert host_hooks(lora).startswith("LoRA layers (Linear) read their adapter scales on the host")


def test_explicit_forward_capture_refuses_step_caches(monkeypatch):
    """cuda_graphs='forward' (asked for, no eager fallback) with a step cache, whose decisions a replay would repeat
    as recorded: refused with an error naming the cache and the way out — at parallelize (nothing installed), at
    enable_cache after a capture (the cache not enabled; the model's numbers unchanged), at a new key's capture
    (a hook added some other way)."""
    import torch.distributed as dist
    from diffusers import FirstBlockCacheConfig
    from diffusers.hooks import apply_first_block_cache

    from cp_ops.integrations.diffusers import parallelize
    from cp_ops.integrations.diffusers.caches import host_hooks
    from diffusers_tiny import build, inputs, sample

    _one_rank_group("gloo")
    monkeypatch.setattr(captured, "BACKEND", Recorder())
    try:
        kw = inputs("wan", 1, (2, 4, 4), 6, torch.Generator().manual_seed(7))
        cached = build("wan")
        cached.enable_cache(FirstBlockCacheConfig(threshold=0.05))
        with pytest.raises(ValueError, match=r"cuda_graphs='forward'\) cannot capture this WanTransformer3DModel: a "
                                             r"step cache \(FBCHeadBlockHook\).*cuda_graphs='auto'.*or False"):
            parallelize(cached, mode="agkv", transport="torch", chunks=1, cuda_graphs="forward")
        assert not hasattr(cached, "_cp_ops_group")  # nothing installed

        base = build("wan")
        ref = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, cuda_graphs=False)
        model = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, cuda_graphs="forward")
        with torch.no_grad():
            want = sample(ref(**kw))
            assert torch.equal(sample(model(**kw)), want) and captured.captured(model).captures == 1
            with pytest.raises(ValueError, match=r"enable_cache: its whole forward is captured.*The cache was not "
                                                 r"enabled"):
                model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
            assert host_hooks(model) is None and torch.equal(sample(model(**kw)), want)

            other = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, cuda_graphs="forward")
            apply_first_block_cache(other, FirstBlockCacheConfig(threshold=0.05))
            with pytest.raises(ValueError, match=r"captured WanTransformer3DModel: this call's forward cannot be "
                                                 r"captured: a step cache \(FBCHeadBlockHook\)"):
                other(**kw)
            assert captured.captured(other).captures == 0
    finally:
        dist.destroy_process_group()
