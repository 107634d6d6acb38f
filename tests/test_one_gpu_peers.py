"""Other libraries' context parallelism (cp_ops.cli.bound_peers: diffusers, para-attn, xDiT, cache-dit) on two GPUs
over NCCL (``run_ranks(..., device="cuda")``, real data moved): each peer
parallelizes FLUX.1-dev's blocks (one double, one single block, the released width and heads, 1024 image + 64 text
tokens, bf16) the way its README does, over the whole world (W = 2), and its output equals one device's within bf16
rounding (the same attention per head, other kernels' shapes), having run its collectives. Ulysses must run; a
ring layout a peer refuses on this machine is skipped with the peer's reason (``cp-ops bound --compare`` lists it
the same way). Marked gpu; skipped without two GPUs or without the peer (its install line said). Two ranks sharing
one GPU cannot carry it: the peers' own collectives on a gloo group of CUDA tensors died with SIGSEGV on an H100
(diffusers, para-attn, xDiT; torch 2.11), the crash cp_ops' own gathers avoid (benchmarks/results/peers)."""

import importlib.util
import os

import pytest
import torch
from dist_util import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")]

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

    dev = torch.device("cuda", rank)
    spec = MODELS["flux"]
    model, cfg = build(spec, "dev", 1, dev, torch.bfloat16)
    model.set_attention_backend("_native_cudnn")  # as the bound sets every side
    g = torch.Generator(device=dev).manual_seed(7)
    kw = spec.make_inputs(cfg, 64, 1, 1, 64, 64, dev, torch.bfloat16, g)
    with torch.no_grad():
        ref = spec.predict(model, kw).float()
        seen = Collectives()
        try:
            built = bound_peers.parallelize(peer, model, layout, dist.group.WORLD, spec.heads(cfg), dev, kw)
            with built.around() if built.around else torch.no_grad(), seen:
                out = spec.predict(model, kw).float()
        except Exception as e:  # noqa: BLE001 - a ring layout the peer refuses here: skipped with its reason
            if layout == "ulysses":
                raise
            with open(os.path.join(out_dir, f"refused{rank}"), "w") as f:
                f.write(f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            return
    assert seen.count >= 2 * (cfg["num_layers"] + cfg["num_single_layers"]), (peer, layout, seen.count)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 3e-2, (peer, layout, rank, err)


@pytest.mark.parametrize("peer", [pytest.param(p, marks=_installed(p)) for p in PEERS])
@pytest.mark.parametrize("layout", ["ulysses", "ring"])
def test_peer_equals_one_device_on_two_gpus(peer, layout, tmp_path):
    run_ranks(_peer_body, 2, peer, layout, str(tmp_path), timeout=300, device="cuda")
    refused = sorted(tmp_path.glob("refused*"))
    if refused:
        pytest.skip(f"{peer} refuses {layout} here: {refused[0].read_text()}")
