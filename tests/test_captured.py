"""cp_ops.captured (whole-forward CUDA-graph capture) and parallelize(cuda_graphs="forward").

On CPU the graph mechanism (cp_ops.captured.BACKEND) is replaced by a recorder that "captures" by running the call
once on the static inputs and "replays" by running it again and writing the results into the captured output
tensors (as a replay rewrites a graph's outputs): the keys, the static-input copies, output cloning, the key cap,
the argument checks and the ranks' agreement run for real. The marked GPU test captures with real CUDA graphs.
"""

import copy

import pytest
import torch
import torch.utils._pytree as pytree

from dist_util import run_ranks

from cp_ops import captured
from cp_ops.captured import CaptureError, call_key, capture_forward, uncapture


class Recorder:
    """A stand-in for CudaGraphs on CPU. ``fail``: an exception its capture raises (after running the call, as a
    real capture would have run the forward's Python); ``events``: what happened, in order."""

    def __init__(self, fail: BaseException | None = None):
        self.fail, self.events, self.pools = fail, [], 0

    def check(self, device):
        pass

    def pool(self, device):
        self.pools += 1
        return ("pool", self.pools)

    def warmup(self, fn, n, device):
        for _ in range(n):
            self.events.append("warmup")
            fn()

    def capture(self, fn, pool, device):
        self.events.append("capture")
        out = fn()
        if self.fail is not None:
            raise self.fail

        def replay():
            self.events.append("replay")
            new = pytree.tree_leaves(fn())
            for o, n in zip(pytree.tree_leaves(out), new):
                if isinstance(o, torch.Tensor):
                    o.copy_(n)  # the graph's own output tensors, rewritten in place
        return replay, out


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(captured, "BACKEND", rec)
    return rec


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(1)))
        self.seen = []  # the tensors each forward got (identity)

    def forward(self, x, y=None, scale=1.0, extra=None):
        self.seen.append(x)
        out = (x @ self.w) * scale
        if y is not None:
            out = out + y
        if extra is not None:
            out = out + extra["b"][0]
        return out, {"sum": out.sum(dim=-1)}


def _eager(net, *a, **k):
    with torch.no_grad():
        return torch.nn.Module.__call__(net, *a, **k)


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_key_separates_what_a_graph_fixes():
    x = _r(3, 4)
    base = call_key((x,), {"scale": 2.0})
    assert call_key((_r(3, 4, seed=5),), {"scale": 2.0}) == base  # other values, same key
    assert call_key((x,), {"scale": 3.0}) != base  # a non-tensor leaf by value
    assert call_key((_r(5, 4),), {"scale": 2.0}) != base  # shape
    assert call_key((x.double(),), {"scale": 2.0}) != base  # dtype
    assert call_key((_r(4, 3).t(),), {"scale": 2.0}) != base  # stride
    assert call_key((x, None), {"scale": 2.0}) != base  # structure
    assert call_key(([x],), {"scale": 2.0}) != base
    with torch.no_grad():
        assert call_key((x,), {"scale": 2.0}) != base  # grad mode
    with torch.inference_mode():
        assert call_key((x,), {"scale": 2.0}) != call_key((x,), {"scale": 2.0, "y": None})
    with pytest.raises(ValueError, match="argument leaf 1 .* is a _Opaque, which is not hashable"):
        call_key((x,), {"z": _Opaque()})


class _Opaque:
    __hash__ = None


def test_replays_on_static_copies_and_equals_eager(recorder):
    net = Net()
    hooks = []
    net.register_forward_pre_hook(lambda m, a: hooks.append("pre"))
    net.register_forward_hook(lambda m, a, o: (o[0] + 1, o[1]))  # a forward hook changes the output
    m = capture_forward(net)
    assert m is net and isinstance(m, Net) and type(m).__name__ == "Net" and type(m) is not Net
    x1, y1, x2, y2 = _r(3, 4, seed=1), _r(3, 4, seed=2), _r(3, 4, seed=3), _r(3, 4, seed=4)
    with torch.no_grad():
        o1 = m(x1, y1, scale=2.0, extra={"b": [y2]})
        o2 = m(x2, y2, scale=2.0, extra={"b": [y1]})
    st = captured.captured(m)
    assert st.captures == 1 and recorder.events == ["warmup", "warmup", "capture", "replay", "replay"]
    assert recorder.pools == 1
    assert all(t is not x1 and t is not x2 for t in net.seen)  # the forward saw the static inputs only
    assert len({id(t) for t in net.seen}) == 1
    assert hooks == ["pre"] * 5  # the hooks are inside the captured call (2 warm-ups, capture, 2 replays)
    e1, e2 = _eager(net, x1, y1, scale=2.0, extra={"b": [y2]}), _eager(net, x2, y2, scale=2.0, extra={"b": [y1]})
    for got, ref in ((o1, e1), (o2, e2)):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1]["sum"], ref[1]["sum"])
    assert not torch.equal(o1[0], o2[0])
    # a new scale or shape captures again; the pool is shared
    with torch.no_grad():
        m(x1, y1, scale=3.0, extra={"b": [y2]})
        m(_r(5, 4), None, scale=2.0)
    assert st.captures == 3 and recorder.pools == 1 and len(st.keys()) == 3
    uncapture(m)
    assert type(m) is Net and captured.captured(m) is None


def test_outputs_cloned_unless_asked_not_to(recorder):
    x1, x2 = _r(2, 4, seed=1), _r(2, 4, seed=2)
    m = capture_forward(Net())
    with torch.no_grad():
        a, b = m(x1)[0], m(x2)[0]  # a CFG loop's two calls of one shape
    assert torch.equal(a, _eager(m, x1)[0]) and torch.equal(b, _eager(m, x2)[0])
    m2 = capture_forward(Net(), clone_outputs=False)
    with torch.no_grad():
        a = m2(x1)[0]
        a_then = a.clone()
        b = m2(x2)[0]
    assert torch.equal(a_then, _eager(m2, x1)[0])
    assert torch.equal(a, b) and not torch.equal(a, a_then)  # the rule: valid until the next call of that key
    with torch.enable_grad():
        out = capture_forward(Net())(x1)[0]
    assert not out.requires_grad  # detached: forward only


def test_key_cap_evicts_least_recently_used(recorder):
    m = capture_forward(Net(), max_keys=2)
    st = captured.captured(m)
    xs = {n: _r(n, 4, seed=n) for n in (1, 2, 3)}
    with torch.no_grad():
        m(xs[1])
        m(xs[2])
        m(xs[1])  # 1 is now the most recent
        m(xs[3])  # evicts 2
        assert st.evictions == 1 and [k[1][0][1] for k in st.keys()] == [(1, 4), (3, 4)]
        out = m(xs[2])  # captured again
    assert st.captures == 4 and st.evictions == 2
    assert torch.equal(out[0], _eager(m, xs[2])[0])


def test_a_version_memo_rebuilds_inside_the_capture(recorder):
    """A memo keyed on an input's identity and version (as CPState's every-key mask) must run its rebuild inside the
    capture: the graph then rebuilds it from the static input at each replay."""

    class Memo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))
            self.src, self.buf, self.builds = None, None, []

        def forward(self, x):
            if not (self.src is not None and self.src[0] is x and self.src[1] == x._version):
                self.buf = x * 2
                self.src = (x, x._version)
                self.builds.append(recorder.events[-1])
            return self.buf + self.w

    m = capture_forward(Memo())
    with torch.no_grad():
        m(_r(3))
    assert "capture" in m.builds, m.builds


def test_argument_checks_and_cpu_error(monkeypatch):
    with pytest.raises(ValueError, match="needs CUDA .* parameters are on cpu"):
        capture_forward(Net())  # the real mechanism on CPU
    monkeypatch.setattr(captured, "BACKEND", Recorder())
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        capture_forward(Net(), warmup=0)
    with pytest.raises(ValueError, match="max_keys must be an int >= 1; got 0"):
        capture_forward(Net(), max_keys=0)
    m = capture_forward(Net())
    with pytest.raises(ValueError, match="already captured"):
        capture_forward(m)
    c = copy.deepcopy(m)  # a copy captures afresh
    with torch.no_grad():
        c(_r(2, 4))
    assert captured.captured(c).captures == 1 and captured.captured(m).captures == 0
    assert captured.captured(c).module is c


def test_a_failed_capture_names_the_reason_and_the_model_line(monkeypatch):
    monkeypatch.setattr(captured, "BACKEND", Recorder())

    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 3:  # the capture (after 2 warm-ups)
                compute_text_seq_len_from_mask()
            return x + self.w

    def compute_text_seq_len_from_mask():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    m = capture_forward(Bad())
    with pytest.raises(CaptureError, match=r"capture failed: capture: RuntimeError: CUDA error: operation not "
                                           r"permitted .*test_captured.py:\d+ in compute_text_seq_len_from_mask\); "
                                           r"known: diffusers' Qwen-Image .*cuda_graphs=True"):
        m(_r(2))

    class ExitRaises(Recorder):  # torch.cuda.graph's exit after a failed capture raises again
        def capture(self, fn, pool, device):
            try:
                return super().capture(fn, pool, device)
            finally:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(captured, "BACKEND", ExitRaises())
    m = capture_forward(Bad())
    with pytest.raises(CaptureError, match=r"capture: RuntimeError: CUDA error: operation not permitted .* in "
                                           r"compute_text_seq_len_from_mask\) \(then: RuntimeError: CUDA error: "
                                           r"operation failed due to a previous error during capture\); known"):
        m(_r(2))
    m2 = capture_forward(Net())
    with pytest.raises(CaptureError, match="eager warm-up .* failed: warm-up: RuntimeError"):
        m2(_r(2, 3))  # a wrong shape fails eagerly already


def test_parallelize_cuda_graphs_argument(monkeypatch):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from cp_ops.integrations.diffusers import parallelize
    from diffusers_tiny import build

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match=r"cuda_graphs must be one of \(False, True, 'forward', 'auto'\).*got "
                                             r"'graphs'"):
            parallelize(build("wan"), cuda_graphs="graphs")
        model = build("wan")
        with pytest.raises(ValueError, match=r"parallelize\(cuda_graphs='forward'\): whole-forward CUDA-graph "
                                             r"capture needs CUDA .* on cpu"):
            parallelize(model, cuda_graphs="forward")
        assert getattr(model, "_cp_ops_group", None) is None  # refused before any hook went in
        with pytest.raises(ValueError, match="cuda_graphs=True needs compile=True"):
            parallelize(build("wan"), cuda_graphs=True)
        monkeypatch.setattr(captured, "BACKEND", Recorder())
        model = parallelize(build("wan"), mode="agkv", transport="torch", chunks=1, cuda_graphs="forward")
        assert captured.captured(model) is not None and type(model).__name__ == "WanTransformer3DModel"
        assert captured.captured(model).group is model._cp_ops_input_group
    finally:
        dist.destroy_process_group()


def _ranks_capture(rank, world_size):
    """2 gloo ranks: the captured parallelized model equals the eager parallelized one (Wan; Qwen-Image with a text
    mask: the every-key mask memo), its second call too (new values); then rank 1's capture fails: both raise,
    naming rank 1 and its reason."""
    from cp_ops.integrations.diffusers import parallelize
    from diffusers_tiny import build, inputs, sample

    captured.BACKEND = Recorder()
    for name, mask in (("wan", False), ("qwenimage", True)):
        base = build(name)
        eager = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, cuda_graphs=False)
        graphed = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, cuda_graphs="forward")
        g = torch.Generator().manual_seed(7)  # the same inputs on every rank
        kws = [inputs(name, 2, (2, 4, 4), 6, g, mask=mask) for _ in range(2)]
        if mask:  # the second call masks other tokens: the replay must see the new mask
            kws[1]["encoder_hidden_states_mask"][0, -2:] = False
        with torch.no_grad():
            outs = [sample(graphed(**kw)) for kw in kws]
            refs = [sample(eager(**kw)) for kw in kws]
            one = [sample(base(**kw)) for kw in kws]
        assert captured.captured(graphed).captures == 1, name
        for o, r, s in zip(outs, refs, one):
            assert torch.equal(o, r), (name, (o - r).abs().max().item())
            err = ((o - s).abs().max() / s.abs().max()).item()
            assert err < 1e-5, (name, err)
        assert not torch.equal(outs[0], outs[1])
    # one rank's capture fails: every rank raises, naming it
    captured.BACKEND = Recorder(fail=RuntimeError("operation not permitted when stream is capturing") if rank == 1
                                else None)
    m = parallelize(build("wan"), mode="agkv", transport="torch", chunks=1, cuda_graphs="forward")
    kw = inputs("wan", 1, (2, 4, 4), 6, torch.Generator().manual_seed(3))
    with pytest.raises(CaptureError) as info:
        with torch.no_grad():
            m(**kw)
    msg = str(info.value)
    assert "failed on rank(s) [1]; rank 1's reason: capture: RuntimeError: operation not permitted" in msg, msg
    assert "cuda_graphs=True" in msg


def test_ranks_agree_and_replay_equals_eager():
    run_ranks(_ranks_capture, 2, timeout=300)


ACTIVATIONS = ("hidden_states", "encoder_hidden_states", "pooled_projections")


def _one_gpu_captured(rank, world_size):
    """Real CUDA graphs, a real NCCL group of one rank on one GPU: the captured forward equals the same model's eager
    forward bitwise, eager blocks and regionally compiled blocks, two inputs (the second a replay); Qwen-Image with a
    text mask captured too (diffusers' pageable copy replaced: capture_safe), and without the replacement its capture
    error names diffusers' function."""
    import torch._dynamo

    from cp_ops.integrations.diffusers import parallelize
    from diffusers_tiny import build, inputs, sample

    dev = torch.device("cuda", 0)
    for name in ("wan", "flux"):
        for compile_ in (False, True):
            torch._dynamo.reset()
            base = build(name).to(dev, torch.bfloat16)
            eager = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, compile=compile_,
                                cuda_graphs=False)
            graphed = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, compile=compile_,
                                  cuda_graphs="forward")
            g = torch.Generator().manual_seed(11)
            kws = []
            for _ in range(2):  # the activations in bf16; ids, timesteps as the tests make them
                kw = inputs(name, 1, (2, 8, 8), 8, g)
                kws.append({k: (v.to(dev, torch.bfloat16) if k in ACTIVATIONS else v.to(dev))
                            if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
            with torch.no_grad():
                outs = [sample(graphed(**kw)) for kw in kws]
                refs = [sample(eager(**kw)) for kw in kws]
            torch.cuda.synchronize()
            assert captured.captured(graphed).captures == 1, (name, compile_)
            for o, r in zip(outs, refs):
                assert torch.equal(o, r), (name, compile_, (o.float() - r.float()).abs().max().item())
            assert not torch.equal(outs[0], outs[1])
    # Qwen-Image with a text mask: diffusers 0.42.1's pageable copy is replaced (capture_safe), so the capture runs
    # and equals eager; without the replacement a direct capture fails, the error naming diffusers' function
    from cp_ops.integrations.diffusers import capture_safe

    torch._dynamo.reset()
    base = build("qwenimage").to(dev, torch.bfloat16)
    kw = inputs("qwenimage", 2, (1, 8, 8), 8, torch.Generator().manual_seed(2), mask=True)
    kw = {k: (v.to(dev, torch.bfloat16) if k in ACTIVATIONS else v.to(dev)) if isinstance(v, torch.Tensor) else v
          for k, v in kw.items()}
    eager = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, cuda_graphs=False)
    graphed = parallelize(copy.deepcopy(base), mode="agkv", transport="torch", chunks=1, cuda_graphs="forward")
    with torch.no_grad():
        o, r = sample(graphed(**kw)), sample(eager(**kw))
    assert captured.captured(graphed).captures == 1 and torch.equal(o, r), (o.float() - r.float()).abs().max()
    capture_safe.undo()
    try:
        captured.capture_forward(eager)
        with pytest.raises(CaptureError, match="compute_text_seq_len_from_mask.*known: diffusers' Qwen-Image"):
            with torch.no_grad():
                eager(**kw)
    finally:
        capture_safe.undo()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_gpu_captured_forward_equals_eager():
    run_ranks(_one_gpu_captured, 1, timeout=600, device="cuda")


def test_an_output_a_replay_cannot_return_afresh_is_refused(recorder):
    """A plain dataclass (not a pytree node) is one output leaf: before (2026-12-02) every replay returned that same
    object, its tensor the graph's own (not cloned or detached: a CFG loop's second call overwrote the first's
    output). Now the capture refuses it, naming the class and what to do; registered as a pytree node, it works."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        sample: torch.Tensor

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(_r(4, 4, seed=1))

        def forward(self, x):
            return Out(x @ self.w), None, 2, "s"

    m = capture_forward(M())
    with pytest.raises(CaptureError, match=r"outputs cannot be returned by a replay: outputs: ValueError: output "
                                           r"leaf 0 is a .*Out, not a tensor.*register_dataclass"):
        m(_r(3, 4))
    pytree.register_dataclass(Out)  # (a class of this test's own: registered for good, harmless)
    x1, x2 = _r(3, 4, seed=2), _r(3, 4, seed=3)
    a, b = m(x1), m(x2)
    assert a[0] is not b[0] and a[1:] == (None, 2, "s")
    assert torch.equal(a[0].sample, _eager(m, x1)[0].sample) and torch.equal(b[0].sample, _eager(m, x2)[0].sample)


def test_an_argument_written_in_place_is_written_back(recorder):
    """A forward that writes an argument in place: a replay writes the static copy only; before (2026-12-02) the
    caller's tensor kept its old values (eager changes it). Now the leaves a warm-up call wrote are copied back after
    each replay (the others are not: no copy for a forward that writes none)."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(_r(4, 4, seed=1))

        def forward(self, x, y):
            x[:, :2].mul_(2)  # through a view: the base's version counter moves too
            return x @ self.w + y

    m = capture_forward(M())
    m(_r(3, 4), _r(3, 4, seed=4))  # capture (the recorder runs the capture call: the first call is not checked)
    assert captured.captured(m).keys() and captured.captured(m)._entries[captured.captured(m).keys()[0]].mutated == (0,)
    x, y = _r(3, 4, seed=2), _r(3, 4, seed=5)
    xe, ye = x.clone(), y.clone()
    out = m(x, y)
    ref = _eager(m, xe, ye)
    assert torch.equal(x, xe) and torch.equal(y, ye) and torch.equal(out, ref)


def test_a_nan_argument_replays(recorder):
    """A float NaN argument (unequal to itself): before (2026-12-02) its key never matched, so every call captured
    anew (and evicted a key past max_keys). Now one capture, then replays."""
    m = capture_forward(Net(), max_keys=2)
    x = _r(3, 4)
    for _ in range(3):
        m(x, scale=float("nan"))
    assert captured.captured(m).captures == 1 and recorder.events.count("replay") == 3


def test_capture_helpers_live_on_the_product_side():
    """cp_ops.captured (product) imports nothing from cp_ops.timing (the measuring tools' timing): the capture
    helpers it uses are its own, and timing's Graphed uses them from here."""
    import ast
    import inspect

    import cp_ops.captured as captured
    import cp_ops.timing as timing

    tree = ast.parse(inspect.getsource(captured))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m == "timing" or m.endswith(".timing") for m in imported), imported
    assert timing.warm_on_side_stream is captured.warm_on_side_stream
    assert timing.failed_ranks is captured.failed_ranks
