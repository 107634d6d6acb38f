"""The ops ``cp_ops.op_def.define`` registers keep what ``torch.library.custom_op`` gave them: their kernels run
outside Dynamo (a frame Dynamo runs eagerly after a graph break calls the op eagerly; its Python body must not be
compiled: on torch 2.13 Dynamo failed on the process group's C++ objects, on 2.11 it compiled the body at every call),
the ``pt2_compliant_tag``, and a reload of the defining modules replaces the ops (it raised, or dropped every op)."""

import os
import subprocess
import sys

import torch
from torch._dynamo.utils import counters

from cp_ops import op_def, ops  # noqa: F401 - ops defines them

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Block:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_kernels_run_outside_dynamo_after_a_graph_break():
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    want = ops.fp8_encode._init_fn(x, "e4m3")

    @torch.compile(backend="eager")
    def f(x):
        with _Block():  # a graph break inside a with block: Dynamo runs this frame eagerly, op call included
            torch._dynamo.graph_break()
            return torch.ops.cp_ops.fp8_encode(x, "e4m3")

    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(f(x), want)
    assert counters["stats"].get("unique_graphs", 0) == 0, dict(counters["stats"])  # no graph of the op's body


def test_ops_are_pt2_compliant():
    assert len(op_def._LIBS) >= 10
    for name in op_def._LIBS:
        assert torch.Tag.pt2_compliant_tag in getattr(torch.ops.cp_ops, name).default.tags, name
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    with torch._dynamo.config.patch(only_allow_pt2_compliant_ops=True):
        out = torch.compile(lambda x: torch.ops.cp_ops.fp8_encode(x * 2, "e4m3"), fullgraph=True, backend="eager")(x)
    assert torch.equal(out, ops.fp8_encode._init_fn(x * 2, "e4m3"))


def test_reloading_the_defining_modules_replaces_the_ops():
    code = """if True:
        import importlib, torch
        import cp_ops.op_def, cp_ops.ops
        x = torch.randn(2, 8, 4, 16, generator=torch.Generator().manual_seed(2))
        want = torch.ops.cp_ops.fp8_encode(x, "e4m3")
        importlib.reload(cp_ops.op_def)  # its libraries are kept: the ops stay
        assert torch.equal(torch.ops.cp_ops.fp8_encode(x, "e4m3"), want)
        importlib.reload(cp_ops.ops)  # every op defined again
        assert torch.equal(torch.ops.cp_ops.fp8_encode(x, "e4m3"), want)
        print("reloaded")
    """
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and "reloaded" in r.stdout, r.stderr[-3000:]


def test_define_refuses_another_namespace():
    import pytest

    with pytest.raises(ValueError, match=r"cp_ops defines ops in its own namespace only; got 'other::x'"):
        op_def.define("other::x")
