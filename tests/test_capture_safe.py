"""diffusers code a whole-forward CUDA-graph capture refuses, replaced by equivalents (cp_ops.integrations.diffusers.
capture_safe): each replacement returns what diffusers' original does, bitwise, on fresh random inputs; applied only
where the original still has the construct; idempotent; undone; applied by parallelize(cuda_graphs="forward")."""

import sys
import types

import pytest
import torch

from cp_ops.integrations.diffusers import capture_safe

qwen = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")


@pytest.fixture
def clean():
    capture_safe.undo()
    yield
    capture_safe.undo()


def test_qwen_text_seq_len_equals_diffusers(clean):
    orig = qwen.compute_text_seq_len_from_mask
    g = torch.Generator().manual_seed(5)
    for b, s in ((1, 7), (3, 12), (2, 1)):
        x = torch.randn(b, s, 8, generator=g)
        masks = [None, torch.rand(b, s, generator=g) > 0.4, (torch.rand(b, s, generator=g) > 0.5).long()]
        empty = torch.rand(b, s, generator=g) > 0.5
        empty[0] = False  # a row with no active token: the whole length
        masks.append(empty)
        for m in masks:
            want, got = orig(x, m), capture_safe._text_seq_len_from_mask(x, m)
            assert want[0] == got[0]
            for a, c in zip(want[1:], got[1:]):
                assert (a is None) == (c is None)
                if a is not None:
                    assert a.dtype == c.dtype and torch.equal(a, c), (b, s, a, c)
    bad = torch.ones(1, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"must match \(batch_size, text_seq_len\)=\(1, 7\)"):
        capture_safe._text_seq_len_from_mask(torch.randn(1, 7, 8), bad)


def test_the_replacement_makes_no_host_to_device_copy(clean):
    """What a capture refuses: diffusers' original copies its Python int to the device (aten::_to_copy / lift_fresh
    from a host scalar), the replacement passes it to torch.where as a scalar (no host tensor at all)."""
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x, m = torch.randn(2, 6, 4), torch.rand(2, 6) > 0.5
    with Seen() as orig_seen:
        qwen.compute_text_seq_len_from_mask(x, m)
    with Seen() as fix_seen:
        capture_safe._text_seq_len_from_mask(x, m)
    assert "as_tensor" in orig_seen.names
    assert "as_tensor" not in fix_seen.names and "tensor" not in fix_seen.names, fix_seen.names


def test_apply_is_scoped_idempotent_and_undone(clean):
    from diffusers_tiny import build

    orig = qwen.compute_text_seq_len_from_mask
    assert capture_safe.apply(build("wan")) == []  # another model's class: nothing
    assert qwen.compute_text_seq_len_from_mask is orig
    key = "diffusers.models.transformers.transformer_qwenimage:compute_text_seq_len_from_mask"
    model = build("qwenimage")
    assert capture_safe.apply(model) == [key]
    assert qwen.compute_text_seq_len_from_mask is capture_safe._text_seq_len_from_mask
    assert capture_safe.apply(model) == [key]  # idempotent
    capture_safe.undo()
    assert qwen.compute_text_seq_len_from_mask is orig


def test_apply_sees_through_compile_and_subclasses(clean):
    """``cp-ops run --compile full --cuda-graphs forward`` applies the fixes to ``torch.compile(model)`` (an
    ``OptimizedModule``, whose class comes from torch): the model underneath is diffusers' Qwen-Image; a subclass of
    it runs the same module function."""
    from diffusers_tiny import build

    key = "diffusers.models.transformers.transformer_qwenimage:compute_text_seq_len_from_mask"
    model = build("qwenimage")
    assert capture_safe.apply(torch.compile(model)) == [key]
    assert qwen.compute_text_seq_len_from_mask is capture_safe._text_seq_len_from_mask
    capture_safe.undo()
    sub = type("MyQwen", (type(model),), {"__module__": "my_pipeline"})
    model.__class__ = sub
    assert capture_safe.apply(model) == [key]
    assert capture_safe.apply(torch.compile(build("wan"))) == []


def test_a_module_that_imported_the_function_by_name_is_fixed_too(clean, monkeypatch):
    """xDiT's Qwen-Image wrapper (a subclass of diffusers' class in its own module) calls the function through the
    name it imported (``from ...transformer_qwenimage import compute_text_seq_len_from_mask``): that name gets the
    replacement too, and undo puts it back."""
    from diffusers_tiny import build

    orig = qwen.compute_text_seq_len_from_mask
    mod = types.ModuleType("fake_xfuser_qwen")
    mod.compute_text_seq_len_from_mask = orig
    monkeypatch.setitem(sys.modules, "fake_xfuser_qwen", mod)
    model = build("qwenimage")
    model.__class__ = type("xFuserQwen", (type(model),), {"__module__": "fake_xfuser_qwen"})
    key = "diffusers.models.transformers.transformer_qwenimage:compute_text_seq_len_from_mask"
    assert capture_safe.apply(model) == [key, "fake_xfuser_qwen:compute_text_seq_len_from_mask"]
    assert mod.compute_text_seq_len_from_mask is capture_safe._text_seq_len_from_mask
    capture_safe.undo()
    assert mod.compute_text_seq_len_from_mask is orig and qwen.compute_text_seq_len_from_mask is orig


def test_apply_again_after_the_original_was_put_back(clean):
    """A fix reported in force is in force: after its module's function was put back by someone else (a
    monkeypatch undone, the module reloaded), apply replaces it again rather than reporting a stale replacement."""
    key = "diffusers.models.transformers.transformer_qwenimage:compute_text_seq_len_from_mask"
    orig = qwen.compute_text_seq_len_from_mask
    assert capture_safe.apply() == [key]
    setattr(qwen, "compute_text_seq_len_from_mask", orig)
    assert capture_safe.apply() == [key]
    assert qwen.compute_text_seq_len_from_mask is capture_safe._text_seq_len_from_mask
    capture_safe.undo()
    assert qwen.compute_text_seq_len_from_mask is orig


def test_a_changed_original_is_left_alone(clean, monkeypatch):
    mod = types.ModuleType("fake_diffusers_mod")
    exec("def f(x):\n    return x + 1\n", mod.__dict__)  # no source on disk: inspect fails, left alone
    monkeypatch.setitem(sys.modules, "fake_diffusers_mod", mod)
    monkeypatch.setattr(capture_safe, "FIXES", (("fake_diffusers_mod", "f", "torch.as_tensor(", lambda x: x),))
    assert capture_safe.apply() == []
    assert mod.f(1) == 2
    # a source without the construct (a diffusers release that changed the function): left alone
    monkeypatch.setattr(capture_safe, "FIXES", (("diffusers.models.transformers.transformer_qwenimage",
                                                 "compute_text_seq_len_from_mask", "a construct not there", None),))
    orig = qwen.compute_text_seq_len_from_mask
    assert capture_safe.apply() == []
    assert qwen.compute_text_seq_len_from_mask is orig


def test_parallelize_forward_capture_applies_it(clean, monkeypatch):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_ops import captured
    from cp_ops.integrations.diffusers import parallelize
    from diffusers_tiny import build

    monkeypatch.setattr(captured, "BACKEND", types.SimpleNamespace(check=lambda device: None))
    orig = qwen.compute_text_seq_len_from_mask
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        parallelize(build("qwenimage"), mode="agkv", transport="torch", chunks=1, cuda_graphs=False)
        assert qwen.compute_text_seq_len_from_mask is orig  # no capture asked: untouched
        parallelize(build("qwenimage"), mode="agkv", transport="torch", chunks=1, cuda_graphs="forward")
        assert qwen.compute_text_seq_len_from_mask is capture_safe._text_seq_len_from_mask
    finally:
        dist.destroy_process_group()
