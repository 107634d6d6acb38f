"""What a pipeline runs must be the same on every rank (else every rank raises, never wrong latents on the rank that
writes the output), and the argument checks of parallelize / parallelize_pipeline speak before anything runs.

The pipeline here is a stand-in with a diffusers pipeline's shape (``components``, ``to``, a denoising loop with
classifier-free guidance around a tiny Wan transformer), so the tests need no ``transformers``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_util import run_ranks

pytest.importorskip("diffusers")


class TinyPipe:
    """A denoising loop: ``steps`` steps, each one transformer forward, two (cond, uncond) when ``guidance_scale > 1``
    — so ranks that differ in ``guidance_scale`` pair one rank's step-2 forward with another's uncond forward."""

    def __init__(self):
        import diffusers_tiny

        self.transformer = diffusers_tiny.build("wan")
        self.components = {"transformer": self.transformer, "scheduler": None}

    def to(self, device):
        self.transformer.to(device)
        return self

    @torch.no_grad()
    def __call__(self, guidance_scale: float = 1.0, num_inference_steps: int = 2, generator=None):
        latents = torch.randn(1, 4, 2, 8, 8, generator=generator)
        g = torch.Generator().manual_seed(1)
        cond, uncond = torch.randn(1, 6, 16, generator=g), torch.zeros(1, 6, 16)
        for i in range(num_inference_steps):
            t = torch.tensor([900 - 300 * i])
            x = self.transformer(hidden_states=latents, timestep=t, encoder_hidden_states=cond)[0]
            if guidance_scale > 1:
                u = self.transformer(hidden_states=latents, timestep=t, encoder_hidden_states=uncond)[0]
                x = u + guidance_scale * (x - u)
            latents = latents - 0.3 * x
        return latents


def _pipeline_calls(rank, w):
    from cp_ops.integrations.diffusers import parallelize_pipeline

    ref = TinyPipe()(guidance_scale=4.0, generator=torch.Generator().manual_seed(0))
    pipe = parallelize_pipeline(TinyPipe(), mode="agkv", transport="torch", chunks=1, device="cpu")
    assert type(pipe).__name__ == "TinyPipe"
    out = pipe(guidance_scale=4.0, generator=torch.Generator().manual_seed(0))  # in step: the unparallelized result
    assert torch.equal(out, ref), (out - ref).abs().max()
    # guidance_scale 1.0 on rank 0, 4.0 on rank 1: every rank raises before any forward, naming the argument
    with pytest.raises(ValueError, match=r"TinyPipe\(\.\.\.\) call #2 \(parallelize_pipeline\): the ranks passed "
                                         r"different arguments: guidance_scale\. Every rank must make the same "
                                         r"pipe\(\.\.\.\) call(.|\n)*rank 0: 1\.0, rank 1: 4\.0"):
        pipe(guidance_scale=1.0 if rank == 0 else 4.0, generator=torch.Generator().manual_seed(0))
    # generators seeded differently: named too
    with pytest.raises(ValueError, match=r"call #3 .*different arguments: generator\."):
        pipe(guidance_scale=4.0, generator=torch.Generator().manual_seed(rank))
    # the pipeline still works after a refused call
    assert torch.equal(pipe(guidance_scale=4.0, generator=torch.Generator().manual_seed(0)), ref)


def test_ranks_that_differ_in_a_pipeline_argument_raise_on_every_rank():
    run_ranks(_pipeline_calls, 2)


def test_parallelize_pipeline_with_device_cuda_says_what_to_do():
    from cp_ops.integrations.diffusers import parallelize_pipeline

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: device='cuda' means cuda:LOCAL_RANK")
    with pytest.raises(ValueError, match=r"parallelize_pipeline\(device='cuda'\): CUDA is not available here: pass "
                                         r"device='cpu', or None"):
        parallelize_pipeline(TinyPipe(), device="cuda")


def test_parallelize_ulysses_refuses_heads_that_w_does_not_divide():
    """W=3 ranks (a 'fake' group: nothing runs) and 4 heads: refused at parallelize, naming the module, not 20 frames
    deep at the first forward."""
    import diffusers_tiny
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_ops.integrations.diffusers import parallelize

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        model = diffusers_tiny.build("wan")
        with pytest.raises(ValueError, match=r"parallelize\(mode='ulysses'\): blocks\.0\.attn1 has heads=4, which W=3 "
                                             r"ranks do not divide .*use mode='agkv' or 'auto'"):
            parallelize(model, mode="ulysses", transport="torch")
        assert getattr(model, "_cp_ops_group", None) is None  # nothing installed
        parallelize(model, mode="agkv", transport="torch")  # the same model takes AGKV
    finally:
        dist.destroy_process_group()
