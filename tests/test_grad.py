"""Forward-only, the same way eager and compiled: a forward with inputs that require grad runs and equals the
no-grad forward; only an actual backward raises the documented error (through q, k or v, every mode)."""

import copy

import pytest
import torch
import torch.distributed as dist

import cp_ops
from dist_util import run_ranks

ERR = r"cp_ops\.{} has no backward: cp_ops targets DiT inference \(forward only\)"


def _eager_backward_raises(rank, w):
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 8, 4, 16, generator=g) for _ in range(3))
    for mode in ("agkv", "ulysses", "auto"):
        with torch.no_grad():
            ref = cp_ops.attention(q, k, v, mode=mode)
        for which in range(3):  # grad through q only, k only, v only
            ins = [t.clone().requires_grad_(i == which) for i, t in enumerate((q, k, v))]
            out = cp_ops.attention(*ins, mode=mode)
            assert out.requires_grad and torch.equal(out, ref), (mode, which)
            with pytest.raises(RuntimeError, match=ERR.format("attention")):
                out.sum().backward()
            assert all(t.grad is None for t in ins)
    # the public collectives too
    kg = k.clone().requires_grad_()
    kf, vf = cp_ops.agkv_gather(kg, v)
    with pytest.raises(RuntimeError, match=ERR.format("agkv_gather_start")):
        (kf.sum() + vf.sum()).backward()
    outs = cp_ops.ulysses_all_to_all(q, kg)
    with pytest.raises(RuntimeError, match=ERR.format("ulysses_start")):
        outs[1].sum().backward()
    back = cp_ops.ulysses_all_to_all_inverse(kg[:, :, : 4 // w].contiguous())
    with pytest.raises(RuntimeError, match=ERR.format("ulysses_inverse_start")):
        back.sum().backward()


def test_eager_backward_raises_through_any_input():
    run_ranks(_eager_backward_raises, 2)


class _Block(torch.nn.Module):
    def __init__(self, h, d, mode):
        super().__init__()
        self.h, self.d, self.mode = h, d, mode
        self.proj = torch.nn.Linear(h * d, 3 * h * d)
        self.out = torch.nn.Linear(h * d, h * d)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.h, self.d)) for t in self.proj(x).chunk(3, dim=-1))
        return self.out(cp_ops.attention(q, k, v, group=dist.group.WORLD, mode=self.mode).flatten(-2))


def _compiled_forward_runs(rank, w):
    torch.manual_seed(0)
    x = torch.randn(1, 16, 4 * 8, generator=torch.Generator().manual_seed(rank + 3))
    for mode in ("agkv", "ulysses"):
        block = _Block(4, 8, mode)  # parameters require grad; no torch.no_grad() anywhere below
        eager = block(x)
        assert eager.requires_grad
        outs = [eager]
        if mode == "agkv":  # Ulysses compiled with grad: the Wan transformer below (= the unparallelized model)
            compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)  # AOTAutograd's joint graph:
            assert compiled.requires_grad                                             # the point (CPU CI time)
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
            outs.append(compiled)
        for out in outs:
            with pytest.raises(RuntimeError, match=ERR.format("attention")):
                out.sum().backward()


def test_compiled_forward_with_grad_runs_and_backward_raises():
    run_ranks(_compiled_forward_runs, 2)


def _wan_with_grad(rank, w):
    from diffusers import WanTransformer3DModel

    from cp_ops.integrations.diffusers import parallelize

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16,
                                  in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                                  num_layers=1).eval()
    assert all(p.requires_grad for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    x, t, text = torch.randn(1, 4, 2, 8, 8, generator=g), torch.tensor([500]), torch.randn(1, 16, 32, generator=g)
    with torch.no_grad():
        ref = model(x, t, text).sample
    cp_model = parallelize(copy.deepcopy(model), mode="ulysses", transport="torch")
    eager = cp_model(x, t, text).sample
    compiled = torch.compile(cp_model, fullgraph=True, backend="aot_eager")(x, t, text).sample
    assert eager.requires_grad and compiled.requires_grad
    assert torch.equal(eager, ref)
    torch.testing.assert_close(compiled, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=ERR.format("attention")):
        compiled.sum().backward()


def test_parallelized_model_with_grad_eager_and_compiled_agree():
    pytest.importorskip("diffusers")
    run_ranks(_wan_with_grad, 2)


def _direct_op_calls(rank, w):
    from cp_ops import layout, ops

    name = dist.group.WORLD.group_name
    g = torch.Generator().manual_seed(rank)
    k, v = (torch.randn(2, 8, 4, 16, generator=g) for _ in range(2))
    mask = (torch.rand(2, 8, generator=g) > 0.5).float()
    send = layout.ulysses_pack([k, v], w)
    c = torch.ops.cp_ops
    rg = lambda t: t.clone().requires_grad_()  # noqa: E731
    cases = [  # (op name in the error, the call, its inputs): defaults left out by the dispatcher, a tensor list with
        # one element that requires grad, the ordering input ``after`` the only one that does, a float key mask
        ("ulysses_start", lambda a, b: c.ulysses_start([a, b], w, name, "torch"), (k, rg(v))),
        ("ulysses_packed_start", lambda a, b: c.ulysses_packed_start(a, w, name, "torch", "", 0, None, 0, b),
         (send, rg(v))),
        ("mask_gather_start", lambda a: c.mask_gather_start(a, w, name), (rg(mask),)),
    ]
    for op, fn, args in cases:
        torch._dynamo.reset()
        out = ops.wait(torch.compile(fn, backend="aot_eager", fullgraph=True)(*args))
        assert out.requires_grad and torch.equal(out.detach(), ops.wait(fn(*args)).detach()), op
        with pytest.raises(RuntimeError, match=ERR.format(op)):
            out.sum().backward()


def test_direct_op_calls_with_grad_compile_and_refuse_backward():
    """Found by a break-test: AOTAutograd traced the ops' backward with one gradient per input the call did not pass
    (ulysses_start with its defaults left out), in the wrong position (``after``), or none (a float key mask)."""
    run_ranks(_direct_op_calls, 2)
