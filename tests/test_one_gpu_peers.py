"""Other libraries' context parallelism (cp_ops.cli.bound_peers: diffusers, para-attn, xDiT, cache-dit) against one
device: each peer parallelizes FLUX.1-dev's blocks (one double, one single block, the released width and heads, 1024
image + 64 text tokens, bf16) the way its README does, over the whole world (W = 2), and its output equals one
device's within bf16 rounding (the same attention per head, other kernels' shapes), having run its collectives.
Ulysses must run; a ring layout a peer refuses on this machine is skipped with the peer's reason (``cp-ops bound
--compare`` lists it the same way). Skipped without the peer (its install line said).

Where the ranks run (marked gpu where on GPUs):

- two GPUs over NCCL (``run_ranks(..., device="cuda")``; skipped without two GPUs);
- two ranks sharing one GPU over tests/staged_pg.py's ``'staged'`` group (``device="one_gpu", backend="staged"``):
  every collective goes through host memory onto gloo. On a plain ``cpu:gloo,cuda:gloo`` group the peers' own
  collectives on CUDA tensors died with SIGSEGV on an H100 (diffusers, para-attn, xDiT; torch 2.11: gloo's CUDA path),
  the crash cp_ops' own gathers avoid (benchmarks/results/peers); the staged group never hands gloo a CUDA tensor;
The same peers on two CPU ranks over plain gloo: tests/test_bound_peers.py.
"""

import importlib.util
import os

import pytest
import torch
from dist_util import run_ranks

PEERS = ("diffusers", "paraattn", "xdit", "cache-dit")


def _installed(peer: str):
    from cp_ops.cli.bound_peers import PEERS as ALL

    p = ALL[peer]
    return pytest.mark.skipif(importlib.util.find_spec(p.module) is None, reason=f"{peer}: {p.install}")


def _peer_body(rank, world, peer, layout, out_dir):
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from cp_ops.cli import bound_peers
    from cp_ops.cli.models import MODELS, build

    class Collectives(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(w in str(func) for w in ("all_to_all", "alltoall", "all_gather", "allgather", "send", "recv")):
                self.count += 1
            return func(*args, **(kwargs or {}))

    def refused(e):
        with open(os.path.join(out_dir, f"refused{rank}"), "w") as f:
            f.write(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")

    spec = MODELS["flux"]
    dev, dtype, tol = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, 3e-2
    model, cfg = build(spec, "dev", 1, dev, dtype)
    model.set_attention_backend("_native_cudnn")  # as the bound sets every side
    g = torch.Generator(device=dev).manual_seed(7)
    kw = spec.make_inputs(cfg, 64, 1, 1, 64, 64, dev, dtype, g)
    staged = dist.get_backend() == "staged"
    if staged:
        import staged_pg
    with torch.no_grad():
        ref = spec.predict(model, kw).float()
        seen = Collectives()
        try:
            built = bound_peers.parallelize(peer, model, layout, dist.group.WORLD, spec.heads(cfg), dev, kw)
        except Exception as e:  # noqa: BLE001 - a ring layout the peer refuses here
            if layout == "ulysses":
                raise
            return refused(e)
        before = sum(staged_pg.CALLS.values()) if staged else 0
        try:
            with built.around() if built.around else torch.no_grad(), seen:
                out = spec.predict(model, kw).float()
        except Exception as e:  # noqa: BLE001 - a ring layout the peer refuses at its first call
            if layout == "ulysses":
                raise
            return refused(e)
    # the collectives it ran: those dispatched (functional collectives; dist.* on NCCL), or on the staged group every
    # call it made (dist.* on a Python group reaches its methods without the dispatcher: xDiT's all-to-alls). Per
    # attention layer Ulysses runs at least two (heads out, heads back), a ring at least one (its K/V, coalesced)
    ran = sum(staged_pg.CALLS.values()) - before if staged else seen.count
    per_layer = 2 if layout == "ulysses" else 1
    assert ran >= seen.count and ran >= per_layer * sum(cfg[k] for k in spec.layer_keys), \
        (peer, layout, seen.count, dict(staged_pg.CALLS) if staged else None)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, (peer, layout, rank, err)


def _skip_refused(tmp_path, peer, layout):
    refused = sorted(tmp_path.glob("refused*"))
    if refused:
        pytest.skip(f"{peer} refuses {layout} here: {refused[0].read_text()}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("peer", [pytest.param(p, marks=_installed(p)) for p in PEERS])
@pytest.mark.parametrize("layout", ["ulysses", "ring"])
def test_peer_equals_one_device_on_two_gpus(peer, layout, tmp_path):
    run_ranks(_peer_body, 2, peer, layout, str(tmp_path), timeout=300, device="cuda")
    _skip_refused(tmp_path, peer, layout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("peer", [pytest.param(p, marks=_installed(p)) for p in PEERS])
@pytest.mark.parametrize("layout", ["ulysses", "ring"])
def test_peer_equals_one_device_on_one_gpu_staged(peer, layout, tmp_path):
    run_ranks(_peer_body, 2, peer, layout, str(tmp_path), timeout=300, device="one_gpu", backend="staged")
    _skip_refused(tmp_path, peer, layout)
