"""Helpers of the overlap-pass tests: compile a block with Inductor and capture post-grad graphs and code."""

from __future__ import annotations

import logging
import operator
import re

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

_SKIP = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand", "getitem", "alias"}


def _short(target) -> str:
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))  # e.g. 'addmm.default'
    ns = getattr(target, "namespace", "aten")
    base = name.split(".")[0]
    return base if ns == "aten" else f"{ns}.{base}"


def compact_graph(graph: fx.Graph) -> str:
    """One line per compute node of a post-grad graph, in order: ``name = op(inputs)``; views are looked
    through (an input shown is the compute node or placeholder behind the views); nodes the overlap pass
    tagged end in ``# window <id>: launch|q|wait``.

    Names are canonical, so the text is the same on every torch version (FX's name counters, the naming of
    AOT placeholders and ``make_fx`` arguments differ between releases, e.g. 2.11 and 2.13): a placeholder
    is ``in<k>`` (k: order of first use in the text), a compute node ``<op>_<k>`` (k: its rank among the
    nodes of that op, in text order). What is checked stays whole: every op, its inputs (which node or
    placeholder, same one where shared), the order and the window tags.
    """

    def source(n: fx.Node) -> fx.Node:
        while n.op == "call_function" and _short(n.target) in _SKIP and n.all_input_nodes:
            n = n.all_input_nodes[0]
        return n

    names: dict[fx.Node, str] = {}
    per_op: dict[str, int] = {}

    def name_of(n: fx.Node) -> str:
        if n not in names:
            if n.op == "call_function":
                op = _short(n.target).split(".")[-1]
                names[n] = f"{op}_{per_op.get(op, 0)}"
                per_op[op] = per_op.get(op, 0) + 1
            else:
                names[n] = f"in{sum(1 for m in names if m.op != 'call_function')}"
        return names[n]

    lines = []
    for n in graph.nodes:
        if n.op != "call_function" or _short(n.target) in _SKIP:
            continue
        ins = []
        for a in n.all_input_nodes:
            s = name_of(source(a))
            if s not in ins:
                ins.append(s)
        line = f"{name_of(n)} = {_short(n.target)}({', '.join(ins)})"
        tag = n.meta.get("cp_ops_window")
        lines.append(f"{line}  # window {tag[0]}: {tag[1]}" if tag else line)
    return "\n".join(lines)


class CaptureGraphs:
    """A post-grad pass that records the graph before and after the overlap pass (``run_pass=False``: records
    it, runs nothing). ``uuid()`` is None: Inductor's FX graph cache is bypassed, so every compile runs it."""

    def __init__(self, run_pass: bool = True) -> None:
        self.run_pass = run_pass
        self.before: list[str] = []
        self.after: list[str] = []
        self.windows: list[int] = []

    def __call__(self, graph: fx.Graph) -> None:
        from cp_ops.passes.overlap import overlap_kv_communication

        self.before.append(compact_graph(graph))
        self.windows.append(overlap_kv_communication(graph) if self.run_pass else 0)
        self.after.append(compact_graph(graph))

    def uuid(self):
        return None


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def compile_and_get(model, args, overlap: bool = True, run: bool = False):
    """Compile ``model`` (Inductor, fullgraph, no FX graph cache) on ``args`` under no_grad: Dynamo, AOTAutograd, the
    post-grad passes (the overlap pass), lowering, scheduling and code generation as usual, but the generated module
    is neither built (its C++ kernels: a compiler process each, the most of a cold cache's time here) nor run, since
    the tests using this read the graphs, the code and the logs only; running compiled code with the pass is the
    real-rank tests' (tests/test_pass_correctness.py, test_uneven.py, ...). ``run=True``: built and run once.

    Returns (output or None, generated code of the call(), CaptureGraphs, log messages of ``cp_ops.passes``).
    """
    import torch._inductor.config as cfg
    from torch._inductor.utils import get_code, run_and_get_code

    from cp_ops import passes
    import cp_ops.passes.overlap  # noqa: F401 - binds passes.overlap

    passes.overlap.STRICT = True  # a failure inside the pass fails the test
    cap = CaptureGraphs(run_pass=overlap)
    opts = passes.inductor_options() if overlap else {}
    opts["post_grad_custom_post_pass"] = cap
    records = LogRecords()
    log = logging.getLogger("cp_ops.passes")
    old_level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(records)
    try:
        torch._dynamo.reset()
        with torch.no_grad(), cfg.patch(fx_graph_cache=False):
            compiled = torch.compile(model, fullgraph=True, options=opts)
            out, codes = run_and_get_code(compiled, *args) if run else (None, get_code(compiled, *args))
    finally:
        log.removeHandler(records)
        log.setLevel(old_level)
    code = "\n".join(codes)
    return out, call_section(code), cap, records.messages


def call_section(code: str) -> str:
    """The body of the generated ``call()``: the kernel launch order."""
    i = code.index("def call(")
    return code[i:]


def kernel_lines(code: str) -> list[str]:
    """The generated code's kernel calls, extern calls, collectives and waits, one per entry, in order."""
    pat = re.compile(r"(extern_kernels\.\w+|cpp_fused\w*|triton_\w+|torch\.ops\.[\w.]+)(?:\.run)?\(")
    return [m.group(1) for line in code.splitlines() for m in [pat.search(line)] if m and "assert" not in line]


class PooledTestTransport:
    """A CPU stand-in for the fast transport's pool: the torch transport's AGKV result copied into one of
    ``slots_per_key`` (= 2) buffers per (op, shape, dtype), taken in turn, so a third launch of one key in flight
    overwrites the first's unread output — as the fast transport's pool would (its own check aside). Register
    it only in rank processes (:func:`register_pooled_test_transport`): the registry is process-wide."""

    name = "pooled_test"
    slots_per_key = 2
    pooled_outputs = True

    def __init__(self) -> None:
        self.pools: dict[tuple, list] = {}
        self.turn: dict[tuple, int] = {}

    def unavailable_reason(self, device):
        return None

    def group_reason(self, group, device):
        return None

    def _slot(self, key, like: torch.Tensor) -> torch.Tensor:
        bufs = self.pools.setdefault(key, [torch.empty_like(like) for _ in range(self.slots_per_key)])
        i = self.turn.get(key, 0)
        self.turn[key] = i + 1
        return bufs[i % self.slots_per_key]

    def agkv_start(self, k, v, group):
        from cp_ops.transport.torch import transport as torch_transport

        k_full, v_full, work = torch_transport.agkv_start(k, v, group)
        work.wait()
        key = ("agkv", tuple(k.shape), k.dtype)
        k_slot, v_slot = self._slot(key + ("k",), k_full), self._slot(key + ("v",), v_full)
        k_slot.copy_(k_full)
        v_slot.copy_(v_full)
        return k_slot, v_slot, work

    def ulysses_start(self, xs, group):
        raise NotImplementedError("pooled_test: AGKV only")

    def ulysses_inverse_start(self, x, group):
        raise NotImplementedError("pooled_test: AGKV only")


def register_pooled_test_transport() -> str:
    """Register :class:`PooledTestTransport` (once per process); returns its name."""
    from cp_ops.transport import base

    if PooledTestTransport.name not in base.names():
        base.register(PooledTestTransport())
    return PooledTestTransport.name


def check_inputs_alive(code: str, op: str, n_inputs: int) -> None:
    """In generated code: the first ``op`` launch's input buffers are freed (``del``) only after the wait on its
    output(s) (Inductor treats the launch as a collective). Raises AssertionError naming the buffer."""
    lines = code.splitlines()
    launch = next(i for i, l in enumerate(lines) if f"cp_ops.{op}.default(" in l)
    m = re.search(rf"(buf\d+) = torch\.ops\.cp_ops\.{op}\.default\((.*)\)", lines[launch])
    out, call_args = m.group(1), m.group(2)
    inputs = re.findall(r"\b(buf\d+)\b", call_args)[:n_inputs]
    assert len(inputs) == n_inputs, call_args
    # Multi-output (AGKV): output i = bufX[i] is written from input i; single output: bufX itself.
    item = {int(mm.group(2)): mm.group(1) for l in lines[launch:] for mm in [re.match(rf"\s*(buf\d+) = {out}\[(\d)\]", l)] if mm}
    for idx, inp in enumerate(inputs):
        waited = item.get(idx, out)
        wait = next(i for i, l in enumerate(lines) if f"wait_tensor.default({waited})" in l)
        freed = [i for i, l in enumerate(lines) if i > launch and re.search(rf"del {inp}\b", l)]
        assert freed, f"{inp} never freed"
        assert freed[0] > wait, f"input {inp} of {op} freed/reused before its wait"


def pool_slot_violations(code: str, op: str, slots: int = 2) -> list[str]:
    """Run generated code's launch order through a pool of ``slots`` buffers taken in turn (as the fast
    transport's, for launches of one key): launch k writes where launch k - slots wrote, so no line after
    launch k may still read launch k - slots's outputs. Returns one line per violation ([] when none).
    All ``op`` launches in ``code`` are taken as one key (same shapes)."""
    lines = code.splitlines()
    launches = []  # (line index, output buffers)
    for i, l in enumerate(lines):
        m = re.search(rf"(buf\d+) = torch\.ops\.cp_ops\.{op}\.default\(", l)
        if m:
            out = m.group(1)
            items = [mm.group(1) for l2 in lines[i + 1 :] for mm in [re.match(rf"\s*(buf\d+) = {out}\[\d+\]", l2)] if mm]
            launches.append((i, items or [out]))
    bad = []
    for k in range(slots, len(launches)):
        start, (old_line, old_bufs) = launches[k][0], launches[k - slots]
        for j, l in enumerate(lines[start + 1 :], start + 1):
            if l.strip().startswith("del "):
                continue
            used = [b for b in old_bufs if re.search(rf"\b{b}\b", l)]
            if used:
                bad.append(f"line {j} reads {used} (launch at line {old_line}) after launch at line {start} took its slot")
    return bad


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    """A 2-rank fake process group for a test module that imports this fixture (shape/tracing tests)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()
