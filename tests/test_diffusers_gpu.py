"""GPU (NCCL, 2 GPUs): every supported tiny diffusers model parallelized equals one GPU, and its forward makes no
device synchronisation that the unparallelized model does not make (torch.cuda.set_sync_debug_mode('error'))."""

import copy

import pytest
import torch

pytest.importorskip("diffusers")

from diffusers_tiny import build, inputs, sample  # noqa: E402
from dist_util import run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

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


def test_cuda_models_equal_and_no_sync():
    run_ranks(_cuda_models, 2, device="cuda")
