"""Graph-pass inspection: the post-grad graphs before/after the overlap pass (expecttest) and the order of
Inductor's generated code (FileCheck): K/V launch → Q matmul → Q norm → Q RoPE → wait → attention.

Traced and compiled in this process on a fake process group (``torch.testing._internal.distributed.fake_pg``):
the code is only inspected, so no real communication is needed (the run itself moves nothing).
"""

from __future__ import annotations

import functools
import re

import expecttest
import pytest
import torch
import torch.distributed as dist
from torch.testing import FileCheck

import cp_ops  # noqa: F401
from cp_ops import passes
import blocks as pb
from pass_util import check_inputs_alive, compile_and_get, fake_group, kernel_lines  # noqa: F401  (fixture)

DIM, HEADS = 64, 4



def _wan_args(s_local=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, s_local, DIM, generator=g)
    cos, sin = pb.rope_tables((2, 4, 4), DIM // HEADS, 0, s_local)
    return x, cos, sin


@functools.cache
def _wan(mode: str):
    """(model, compile_and_get(model, _wan_args())) for a WanBlock of ``mode``, compiled once per process: several
    tests read the same compiled block's graphs, code and logs."""
    model = pb.WanBlock(DIM, HEADS, mode=mode)
    return model, compile_and_get(model, _wan_args())


# Q-side checks shared by the blocks: Q GEMM(s) named by their Dynamo source node, then the Q norm
# (a fused kernel with rsqrt) and the Q RoPE (neg/stack: in the same kernel on CPU, or a later one).
def _check_q_window(fc: FileCheck, q_gemms: tuple[str, ...]) -> FileCheck:
    for name in q_gemms:
        fc = fc.check(f"Source Nodes: [{name}],").check_next("extern_kernels.")
    return fc.check_regex(r"fused\w*rsqrt").check_regex(r"(neg|stack)\w*\(")


@pytest.mark.usefixtures("inductor_kernels")  # where the launches land among fused kernels, the generated code
class TestOverlapPass(expecttest.TestCase):
    def test_wan_agkv_graph_and_code_order(self):
        model, (_, code, cap, logs) = _wan("agkv")
        args = _wan_args()
        self.assertEqual(cap.windows, [1])
        self.assertExpectedInline(cap.after[0], """\
addmm_0 = addmm(in0, in1, in2)
pow_0 = pow(addmm_0)
mean_0 = mean(pow_0)
add_0 = add(mean_0)
rsqrt_0 = rsqrt(add_0)
mul_0 = mul(addmm_0, rsqrt_0)
mul_1 = mul(mul_0, in3)
mul_2 = mul(mul_1, in4)
select_0 = select(mul_1)
neg_0 = neg(select_0)
select_1 = select(mul_1)
cat_0 = cat(neg_0, select_1)
mul_3 = mul(cat_0, in5)
add_1 = add(mul_2, mul_3)
addmm_1 = addmm(in6, in1, in7)
agkv_gather_start_0 = cp_ops.agkv_gather_start(add_1, addmm_1)  # window 0: launch
addmm_2 = addmm(in8, in1, in9)  # window 0: q
pow_1 = pow(addmm_2)  # window 0: q
mean_1 = mean(pow_1)  # window 0: q
add_2 = add(mean_1)  # window 0: q
rsqrt_1 = rsqrt(add_2)  # window 0: q
mul_4 = mul(addmm_2, rsqrt_1)  # window 0: q
mul_5 = mul(mul_4, in10)  # window 0: q
mul_6 = mul(mul_5, in4)  # window 0: q
select_2 = select(mul_5)  # window 0: q
neg_1 = neg(select_2)  # window 0: q
select_3 = select(mul_5)  # window 0: q
cat_1 = cat(neg_1, select_3)  # window 0: q
mul_7 = mul(cat_1, in5)  # window 0: q
add_3 = add(mul_6, mul_7)  # window 0: q
wait_tensor_0 = _c10d_functional.wait_tensor(agkv_gather_start_0)  # window 0: wait
wait_tensor_1 = _c10d_functional.wait_tensor(agkv_gather_start_0)  # window 0: wait
_scaled_dot_product_flash_attention_for_cpu_0 = _scaled_dot_product_flash_attention_for_cpu(add_3, wait_tensor_0, wait_tensor_1)
addmm_3 = addmm(in11, _scaled_dot_product_flash_attention_for_cpu_0, in12)""")
        fc = FileCheck().check("def call(").check("torch.ops.cp_ops.agkv_gather_start.default(")
        _check_q_window(fc, ("linear",)).check("wait_tensor.default(").check("wait_tensor.default(").check(
            "_scaled_dot_product_flash_attention_for_cpu.default("
        ).run(code)
        # The K/V work is all before the launch: the K GEMM ('linear_1') and V GEMM ('linear_2').
        FileCheck().check("Source Nodes: [linear_1],").check("Source Nodes: [linear_2],").check(
            "cp_ops.agkv_gather_start.default("
        ).run(code)
        self.assertTrue(any("window 0:" in m and "agkv_gather_start" in m for m in logs), logs)

        # Without the pass, Inductor's fusion puts the Q GEMM and Q norm/RoPE before the launch: nothing overlaps.
        _, code_off, _, _ = compile_and_get(model, args, overlap=False)
        FileCheck().check("Source Nodes: [linear],").check("cp_ops.agkv_gather_start.default(").run(code_off)

    def test_launch_inputs_stay_alive_until_wait(self):
        # Inductor knows the launch is a collective: its input buffers are not freed or reused before the wait.
        _, code, _, _ = _wan("agkv")[1]
        self._check_inputs_alive(code, "agkv_gather_start", 2)
        # Ulysses K/V launch: its send buffer (written by the K norm/RoPE kernel and V's copy) stays alive until
        # its wait.
        _, code, _, _ = _wan("ulysses")[1]
        self._check_inputs_alive(code, "ulysses_packed_start", 1)

    def test_launch_outputs_never_recycled(self):
        # The fast transport's outputs are views of pooled symmetric buffers that peers write again at a later
        # call: Inductor must not recycle them for other tensors (it would, e.g. for the out projection).
        _, code, _, _ = compile_and_get(pb.Stack(DIM, HEADS, layers=2, mode="ulysses"), _wan_args())
        outs = re.findall(r"(buf\d+) = torch\.ops\.cp_ops\.\w+\.default\(", code)
        self.assertEqual(len(outs), 6, code)  # per layer: [k, v] launch, [q] launch, inverse
        recycled = [l.strip() for l in code.splitlines() for b in outs if re.search(rf"del {b}\s+# reuse", l)]
        self.assertEqual(recycled, [])

    def _check_inputs_alive(self, code: str, op: str, n_inputs: int):
        check_inputs_alive(code, op, n_inputs)

    def test_wan_ulysses_split_graph_and_code_order(self):
        _, (_, code, cap, logs) = _wan("ulysses")
        self.assertEqual(cap.windows, [1])
        self.assertExpectedInline(cap.before[0], """\
addmm_0 = addmm(in0, in1, in2)
pow_0 = pow(addmm_0)
mean_0 = mean(pow_0)
add_0 = add(mean_0)
rsqrt_0 = rsqrt(add_0)
mul_0 = mul(addmm_0, rsqrt_0)
mul_1 = mul(mul_0, in3)
mul_2 = mul(mul_1, in4)
select_0 = select(mul_1)
neg_0 = neg(select_0)
select_1 = select(mul_1)
cat_0 = cat(neg_0, select_1)
mul_3 = mul(cat_0, in5)
add_1 = add(mul_2, mul_3)
addmm_1 = addmm(in6, in1, in7)
pow_1 = pow(addmm_1)
mean_1 = mean(pow_1)
add_2 = add(mean_1)
rsqrt_1 = rsqrt(add_2)
mul_4 = mul(addmm_1, rsqrt_1)
mul_5 = mul(mul_4, in8)
mul_6 = mul(mul_5, in4)
select_2 = select(mul_5)
neg_1 = neg(select_2)
select_3 = select(mul_5)
cat_1 = cat(neg_1, select_3)
mul_7 = mul(cat_1, in5)
add_3 = add(mul_6, mul_7)
addmm_2 = addmm(in9, in1, in10)
cat_2 = cat(add_1, add_3, addmm_2)
ulysses_packed_start_0 = cp_ops.ulysses_packed_start(cat_2)
wait_tensor_0 = _c10d_functional.wait_tensor(ulysses_packed_start_0)
select_4 = select(wait_tensor_0)
select_5 = select(wait_tensor_0)
select_6 = select(wait_tensor_0)
_scaled_dot_product_flash_attention_for_cpu_0 = _scaled_dot_product_flash_attention_for_cpu(select_4, select_5, select_6)
ulysses_inverse_start_0 = cp_ops.ulysses_inverse_start(_scaled_dot_product_flash_attention_for_cpu_0)
wait_tensor_1 = _c10d_functional.wait_tensor(ulysses_inverse_start_0)
clone_0 = clone(wait_tensor_1)
addmm_3 = addmm(in11, clone_0, in12)""")
        self.assertExpectedInline(cap.after[0], """\
addmm_0 = addmm(in0, in1, in2)
pow_0 = pow(addmm_0)
mean_0 = mean(pow_0)
add_0 = add(mean_0)
rsqrt_0 = rsqrt(add_0)
mul_0 = mul(addmm_0, rsqrt_0)
mul_1 = mul(mul_0, in3)
mul_2 = mul(mul_1, in4)
select_0 = select(mul_1)
neg_0 = neg(select_0)
select_1 = select(mul_1)
cat_0 = cat(neg_0, select_1)
mul_3 = mul(cat_0, in5)
add_1 = add(mul_2, mul_3)
addmm_1 = addmm(in6, in1, in7)
cat_1 = cat(add_1, addmm_1)
ulysses_packed_start_0 = cp_ops.ulysses_packed_start(cat_1)  # window 0: launch
addmm_2 = addmm(in8, in1, in9)  # window 0: q
pow_1 = pow(addmm_2)  # window 0: q
mean_1 = mean(pow_1)  # window 0: q
add_2 = add(mean_1)  # window 0: q
rsqrt_1 = rsqrt(add_2)  # window 0: q
mul_4 = mul(addmm_2, rsqrt_1)  # window 0: q
mul_5 = mul(mul_4, in10)  # window 0: q
mul_6 = mul(mul_5, in4)  # window 0: q
select_2 = select(mul_5)  # window 0: q
neg_1 = neg(select_2)  # window 0: q
select_3 = select(mul_5)  # window 0: q
cat_2 = cat(neg_1, select_3)  # window 0: q
mul_7 = mul(cat_2, in5)  # window 0: q
add_3 = add(mul_6, mul_7)  # window 0: q
cat_3 = cat(add_3)  # window 0: q
ulysses_packed_start_1 = cp_ops.ulysses_packed_start(cat_3)  # window 0: q
wait_tensor_0 = _c10d_functional.wait_tensor(ulysses_packed_start_1)
select_4 = select(wait_tensor_0)
wait_tensor_1 = _c10d_functional.wait_tensor(ulysses_packed_start_0)  # window 0: wait
select_5 = select(wait_tensor_1)
select_6 = select(wait_tensor_1)
_scaled_dot_product_flash_attention_for_cpu_0 = _scaled_dot_product_flash_attention_for_cpu(select_4, select_5, select_6)
ulysses_inverse_start_0 = cp_ops.ulysses_inverse_start(_scaled_dot_product_flash_attention_for_cpu_0)
wait_tensor_2 = _c10d_functional.wait_tensor(ulysses_inverse_start_0)
clone_0 = clone(wait_tensor_2)
addmm_3 = addmm(in11, clone_0, in12)""")
        # The traced send buffer split by the pass into K/V and Q stacks: the K/V launch early, its send buffer written
        # by the K norm/RoPE kernel (no copy between), the Q launch last, inside the window, its send buffer written by
        # the Q norm/RoPE kernel.
        fc = FileCheck().check("def call(").check_regex(r"cpp_fused\w*rsqrt\w*stack\w*\(").check(
            "cp_ops.ulysses_packed_start.default(")
        _check_q_window(fc, ("linear",)).check_regex(r"cp_ops\.ulysses_packed_start\.default\(buf\d+, 2, '0', 'torch', '-'").check(
            "wait_tensor.default("
        ).check("wait_tensor.default(").check("_scaled_dot_product_flash_attention_for_cpu.default(").run(code)
        launches = re.findall(r"= torch\.ops\.cp_ops\.(\w+)\.default\(", code)
        self.assertEqual(launches, ["ulysses_packed_start", "ulysses_packed_start", "ulysses_inverse_start"])
        self.assertTrue(any("split ulysses_packed_start" in m for m in logs), logs)

    def test_flux_joint_tokens_per_head_norm(self):
        model = pb.FluxBlock(DIM, HEADS, mode="agkv")
        g = torch.Generator().manual_seed(1)
        x, txt = torch.randn(1, 16, DIM, generator=g), torch.randn(1, 8, DIM, generator=g)
        cos, sin = pb.rope_tables((3, 4, 2), DIM // HEADS, 0, 24)
        _, code, cap, _ = compile_and_get(model, (x, txt, cos, sin))
        self.assertEqual(cap.windows, [1])
        # Both Q projections (text: 'linear', image: 'linear_1') run inside the window.
        fc = FileCheck().check("def call(").check("cp_ops.agkv_gather_start.default(")
        _check_q_window(fc, ("linear", "linear_1")).check("wait_tensor.default(").check(
            "_scaled_dot_product_flash_attention_for_cpu.default("
        ).run(code)
        # All four K/V projections before the launch.
        fc = FileCheck()
        for name in ("linear_2", "linear_3", "linear_4", "linear_5"):
            fc = fc.check(f"Source Nodes: [{name}],")
        fc.check("cp_ops.agkv_gather_start.default(").run(code)

    def test_fused_qkv_kept_whole(self):
        # Pinned behaviour: the fused QKV GEMM is not split (logged); the window holds Q norm + RoPE.
        model = pb.FusedQKVBlock(DIM, HEADS, mode="agkv")
        _, code, cap, logs = compile_and_get(model, _wan_args())
        self.assertEqual(cap.windows, [1])
        kernels = kernel_lines(code)
        self.assertEqual(sum(k.startswith("extern_kernels.") for k in kernels), 2, kernels)  # qkv + out
        self.assertTrue(any("fused projection" in m and "kept as one GEMM" in m for m in logs), logs)
        fc = FileCheck().check("def call(").check("Source Nodes: [linear],").check_next("extern_kernels.addmm(")
        fc.check("cp_ops.agkv_gather_start.default(").check_regex(r"fused\w*rsqrt").check_regex(
            r"(neg|stack)\w*\("
        ).check("wait_tensor.default(").check("_scaled_dot_product_flash_attention_for_cpu.default(").run(code)

    def test_two_layers_independent_windows(self):
        model = pb.Stack(DIM, HEADS, layers=2, mode="agkv")
        _, code, cap, logs = compile_and_get(model, _wan_args())
        self.assertEqual(cap.windows, [2])
        self.assertEqual(sum("pinned in the scheduler" in m for m in logs), 2, logs)
        # Layer 0: Q GEMM 'linear'; layer 1: Q GEMM 'linear_4'. Layer 1's launch after layer 0's attention.
        fc = FileCheck().check("def call(").check("cp_ops.agkv_gather_start.default(")
        fc = _check_q_window(fc, ("linear",)).check("wait_tensor.default(").check("_scaled_dot_product")
        fc = fc.check("cp_ops.agkv_gather_start.default(")
        _check_q_window(fc, ("linear_4",)).check("wait_tensor.default(").check("_scaled_dot_product").run(code)
        # Exactly one launch and two waits between consecutive attentions: no window spans layers.
        kernels = kernel_lines(code)
        attn = [i for i, k in enumerate(kernels) if k.startswith("torch.ops.aten._scaled_dot_product")]
        launches = [i for i, k in enumerate(kernels) if "agkv_gather_start.default" in k]
        self.assertEqual(len(attn), 2)
        self.assertTrue(launches[0] < attn[0] < launches[1] < attn[1], kernels)

    def test_no_cp_ops_graph_unchanged(self):
        model = pb.WanBlock(DIM, HEADS, cp=False)
        _, code, cap, logs = compile_and_get(model, _wan_args())
        self.assertEqual(cap.windows, [0])
        self.assertEqual(cap.before, cap.after)
        self.assertFalse(logs)
        self.assertNotIn("cp_ops", code)

    def test_uuid_stable_and_fx_graph_cache_hits(self):
        import tempfile

        import torch._inductor.config as cfg
        from torch._dynamo.utils import counters

        self.assertIsNotNone(passes.OverlapPass().uuid())
        self.assertEqual(passes.OverlapPass().uuid(), passes.OverlapPass().uuid())
        model, args = pb.WanBlock(DIM, HEADS, mode="agkv"), _wan_args()
        with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
            mp.setenv("TORCHINDUCTOR_CACHE_DIR", d)
            outs = []
            for _ in range(2):
                torch._dynamo.reset()
                counters.clear()
                with torch.no_grad(), cfg.patch(fx_graph_cache=True, force_disable_caches=False):
                    outs.append(cp_ops.compile(model, fullgraph=True)(*args))
            self.assertEqual(counters["inductor"]["fxgraph_cache_hit"], 1, dict(counters["inductor"]))
        self.assertTrue(torch.equal(outs[0], outs[1]))

    def test_install_and_context_manager(self):
        import torch._inductor.config as cfg

        before = cfg.post_grad_custom_post_pass
        with passes.enabled():
            self.assertIsInstance(cfg.post_grad_custom_post_pass, passes.OverlapPass)
        self.assertIs(cfg.post_grad_custom_post_pass, before)
        passes.install()
        try:
            self.assertIsInstance(cfg.post_grad_custom_post_pass, passes.OverlapPass)
            passes.install()  # idempotent: not wrapped twice
            self.assertIsNone(cfg.post_grad_custom_post_pass.inner)
        finally:
            passes.uninstall()
        self.assertIs(cfg.post_grad_custom_post_pass, before)
        with self.assertRaisesRegex(ValueError, "backend='inductor'.*'eager'"):
            cp_ops.compile(torch.nn.Linear(2, 2), backend="eager")


class TestOverlapPassOnTracedGraph(expecttest.TestCase):
    """The FX pass alone on a graph in model order (q first, as Wan computes it), traced with make_fx: in
    Inductor, inference graphs come in partly reordered (``reorder_for_locality``); here nothing has moved."""

    def _traced(self, mode):
        from torch.fx.experimental.proxy_tensor import make_fx

        torch.manual_seed(0)
        block = pb.WanBlock(DIM, HEADS, mode=mode)
        params = {k: v.detach() for k, v in block.named_parameters()}

        def fn(params, x, c, s):
            return torch.func.functional_call(block, params, (x, c, s))

        with torch.no_grad():
            return make_fx(fn, tracing_mode="fake")(params, *_wan_args())

    def test_agkv_kv_chains_and_launch_move_ahead_of_q(self):
        from cp_ops.passes.overlap import overlap_kv_communication
        from pass_util import compact_graph

        gm = self._traced("agkv")
        before = compact_graph(gm.graph)
        self.assertEqual(overlap_kv_communication(gm.graph), 1)
        after = compact_graph(gm.graph)
        self.assertExpectedInline(before, """\
addmm_0 = addmm(in0, in1, in2)
pow_0 = pow(addmm_0)
mean_0 = mean(pow_0)
add_0 = add(mean_0)
rsqrt_0 = rsqrt(add_0)
mul_0 = mul(addmm_0, rsqrt_0)
mul_1 = mul(mul_0, in3)
addmm_1 = addmm(in4, in1, in5)
pow_1 = pow(addmm_1)
mean_1 = mean(pow_1)
add_1 = add(mean_1)
rsqrt_1 = rsqrt(add_1)
mul_2 = mul(addmm_1, rsqrt_1)
mul_3 = mul(mul_2, in6)
addmm_2 = addmm(in7, in1, in8)
select_0 = select(mul_1)
neg_0 = neg(select_0)
select_1 = select(mul_1)
stack_0 = stack(neg_0, select_1)
mul_4 = mul(mul_1, in9)
mul_5 = mul(stack_0, in10)
add_2 = add(mul_4, mul_5)
select_2 = select(mul_3)
neg_1 = neg(select_2)
select_3 = select(mul_3)
stack_1 = stack(neg_1, select_3)
mul_6 = mul(mul_3, in9)
mul_7 = mul(stack_1, in10)
add_3 = add(mul_6, mul_7)
agkv_gather_start_0 = cp_ops.agkv_gather_start(add_3, addmm_2)
wait_tensor_0 = _c10d_functional.wait_tensor(agkv_gather_start_0)
wait_tensor_1 = _c10d_functional.wait_tensor(agkv_gather_start_0)
_scaled_dot_product_flash_attention_for_cpu_0 = _scaled_dot_product_flash_attention_for_cpu(add_2, wait_tensor_0, wait_tensor_1)
addmm_3 = addmm(in11, _scaled_dot_product_flash_attention_for_cpu_0, in12)""")
        self.assertExpectedInline(after, """\
addmm_0 = addmm(in0, in1, in2)
pow_0 = pow(addmm_0)
mean_0 = mean(pow_0)
add_0 = add(mean_0)
rsqrt_0 = rsqrt(add_0)
mul_0 = mul(addmm_0, rsqrt_0)
mul_1 = mul(mul_0, in3)
addmm_1 = addmm(in4, in1, in5)
select_0 = select(mul_1)
neg_0 = neg(select_0)
select_1 = select(mul_1)
stack_0 = stack(neg_0, select_1)
mul_2 = mul(mul_1, in6)
mul_3 = mul(stack_0, in7)
add_1 = add(mul_2, mul_3)
agkv_gather_start_0 = cp_ops.agkv_gather_start(add_1, addmm_1)  # window 0: launch
addmm_2 = addmm(in8, in1, in9)  # window 0: q
pow_1 = pow(addmm_2)  # window 0: q
mean_1 = mean(pow_1)  # window 0: q
add_2 = add(mean_1)  # window 0: q
rsqrt_1 = rsqrt(add_2)  # window 0: q
mul_4 = mul(addmm_2, rsqrt_1)  # window 0: q
mul_5 = mul(mul_4, in10)  # window 0: q
select_2 = select(mul_5)  # window 0: q
neg_1 = neg(select_2)  # window 0: q
select_3 = select(mul_5)  # window 0: q
stack_1 = stack(neg_1, select_3)  # window 0: q
mul_6 = mul(mul_5, in6)  # window 0: q
mul_7 = mul(stack_1, in7)  # window 0: q
add_3 = add(mul_6, mul_7)  # window 0: q
wait_tensor_0 = _c10d_functional.wait_tensor(agkv_gather_start_0)  # window 0: wait
wait_tensor_1 = _c10d_functional.wait_tensor(agkv_gather_start_0)  # window 0: wait
_scaled_dot_product_flash_attention_for_cpu_0 = _scaled_dot_product_flash_attention_for_cpu(add_3, wait_tensor_0, wait_tensor_1)
addmm_3 = addmm(in11, _scaled_dot_product_flash_attention_for_cpu_0, in12)""")
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        launch = next(n for n in nodes if "agkv_gather_start" in str(n.target))
        gemms = [n for n in nodes if n.target is torch.ops.aten.addmm.default]
        q_gemm = next(g for g in gemms if g.meta.get("cp_ops_window") == (0, "q"))
        waits = [n for n in nodes if n.target is torch.ops._c10d_functional.wait_tensor.default]
        sdpa = next(n for n in nodes if "scaled_dot_product" in str(n.target))
        # launch right after its last input, then the Q GEMM, the waits right before attention
        self.assertIs(nodes[pos[launch] - 1], max(launch.all_input_nodes, key=pos.__getitem__))
        self.assertLess(pos[launch], pos[q_gemm])
        self.assertTrue(all(pos[q_gemm] < pos[w] < pos[sdpa] for w in waits))


@pytest.mark.usefixtures("inductor_kernels")
@pytest.mark.parametrize("mode", ["agkv", "ulysses"])
def test_diffusers_wan_transformer_one_window_per_layer(mode):
    """A real DiT: diffusers' Wan transformer parallelized by cp_ops.integrations.diffusers and compiled whole: its
    self-attention gets its window (Q GEMM + Q norm/RoPE kernel inside), its cross-attention none. One layer: a window
    per layer of a stack in one graph is TestOverlapPass.test_two_layers_independent_windows (AGKV) and
    test_launch_outputs_never_recycled (Ulysses)."""
    pytest.importorskip("diffusers")
    from diffusers import WanTransformer3DModel

    from cp_ops.integrations.diffusers import parallelize

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1).eval()
    model = parallelize(model, mode=mode, transport="torch")

    class Sample(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, t, text):
            return self.m(x, t, text, return_dict=False)[0]

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(1, 4, 2, 8, 8, generator=g), torch.tensor([500]), torch.randn(1, 16, 32, generator=g))
    _, code, cap, logs = compile_and_get(Sample(model), args)
    assert cap.windows == [1], logs
    kernels = kernel_lines(code)
    launch = "cp_ops.agkv_gather_start" if mode == "agkv" else "cp_ops.ulysses_packed_start"
    windows, cur = [], None
    for k in kernels:
        if launch in k and cur is None:
            cur = []
        elif "wait_tensor" in k and cur is not None:
            windows.append(cur)
            cur = None
        elif cur is not None:
            cur.append(k)
    assert len(windows) == 1, kernels
    for w in windows:
        assert w[0].startswith("extern_kernels."), w  # the Q projection first
        assert any("rsqrt" in k for k in w[1:]), w  # then the Q norm (and RoPE, fused on CPU)
        if mode == "ulysses":
            assert w[-1] == "torch.ops.cp_ops.ulysses_packed_start.default", w  # Q's all-to-all last


def test_pass_failure_leaves_graph_alone_with_warning(monkeypatch, caplog):
    """A bug inside the pass must not break the user's compile: that launch keeps its place, with a warning."""
    import cp_ops.passes.overlap as ov
    from pass_util import compact_graph

    gm = TestOverlapPassOnTracedGraph()._traced("agkv")
    before = compact_graph(gm.graph)

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(ov, "STRICT", False)
    monkeypatch.setattr(ov, "_open_window", boom)
    with caplog.at_level("WARNING", logger="cp_ops.passes"):
        assert ov.overlap_kv_communication(gm.graph) == 0
    assert compact_graph(gm.graph) == before
    assert "no overlap window for agkv_gather_start: RuntimeError: injected failure" in caplog.text
    monkeypatch.setattr(ov, "STRICT", True)
    with pytest.raises(RuntimeError, match="injected failure"):
        ov.overlap_kv_communication(gm.graph)


def test_equal_options_share_compiled_frame():
    """Each cp_ops.compile call builds new pass objects; they compare equal (same class, same inner pass), so two
    instances of a repeated block compiled separately (regional compilation) share one Dynamo frame instead of
    recompiling the shared forward per instance (Dynamo reuses a frame only under an equal backend)."""
    from torch._dynamo.utils import counters

    assert passes.inductor_options() == passes.inductor_options()
    assert passes.OverlapPass() != passes.PinWindows() and passes.OverlapPass(len) != passes.OverlapPass()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.lin(x))

    torch._dynamo.reset()
    counters.clear()
    blocks = [Block() for _ in range(3)]
    for b in blocks:
        b.forward = cp_ops.compile(b.forward, fullgraph=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for b in blocks:
            torch.testing.assert_close(b(x), torch.relu(b.lin(x)))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("form", ["stack", "cat6", "view_cat"])
def test_packed_send_split_in_every_form(form):
    """The traced Ulysses send buffer reaches the post-grad graph as stack(parts, 3), as view(cat(parts, 3)) (torch
    2.13's decomposition) or as cat of [W, B, S, 1, hs, D] parts (stack through unsqueeze): each is split into K/V
    and Q stacks of the same parts, the selects remapped (values bitwise: the same bytes, other strides)."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cp_ops.passes import overlap as ov

    aten = torch.ops.aten
    w, b, s, hs, d = 2, 1, 4, 2, 8
    g = fx.Graph()
    with FakeTensorMode() as mode:
        xs = [g.placeholder(f"x{i}") for i in range(3)]
        for i, x in enumerate(xs):
            x.meta["val"] = mode.from_tensor(torch.randn(w, b, s, hs, d))
        if form == "stack":
            send = g.call_function(aten.stack.default, (xs, 3))
        elif form == "cat6":
            ups = [g.call_function(aten.unsqueeze.default, (x, 3)) for x in xs]
            send = g.call_function(aten.cat.default, (ups, 3))
        else:
            cat = g.call_function(aten.cat.default, (xs, 3))
            send = g.call_function(aten.view.default, (cat, [w, b, s, 3, hs, d]))
        launch = g.call_function(torch.ops.cp_ops.ulysses_packed_start.default, (send, w, "0", "torch", "c", 1, None, 3))
        wait = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (launch,))
        sels = [g.call_function(aten.select.int, (wait, 3, i)) for i in range(3)]
        attn = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, tuple(sels))
        g.output(attn)
        for n in g.nodes:
            if n.op == "call_function" and "val" not in n.meta:
                n.meta["val"] = ov._fake_val(n.target, n.args)
        dead = []
        kv = ov._split_packed_send(g, launch, ov._order(g), dead)
    assert kv is not None
    launches = [n for n in g.nodes if n.target is torch.ops.cp_ops.ulysses_packed_start.default and n not in dead]
    assert [tuple(n.args[0].meta["val"].shape)[3] for n in launches] == [2, 1]  # K/V (slots 1, 2), then Q (slot 0)
    # K/V exchanges, under the call's name marked split (an eager peer sends the buffer whole: every rank raises);
    # Q does not
    assert launches[0].args[4:6] == (f"c {ov.SPLIT_NOTE}", 1) and launches[1].args[4] == "-"
    q_sel, k_sel, v_sel = sels
    assert q_sel.args[0].args[0] is launches[1] and q_sel.args[2] == 0
    assert k_sel.args[0].args[0] is launches[0] and (k_sel.args[2], v_sel.args[2]) == (0, 1)


class _UnevenUlysses(torch.nn.Module):
    """Q, K, V projections → Ulysses over uneven shards (rank 0 holds 9 of 16 tokens) → output projection."""

    def __init__(self):
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.to_out = (torch.nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):
        q, k, v = (f(x).unflatten(-1, (HEADS, -1)) for f in (self.to_q, self.to_k, self.to_v))
        return self.to_out(cp_ops.attention(q, k, v, mode="ulysses", seq_lens=(9, 7)).flatten(-2))


def test_uneven_ulysses_opens_a_window(fake_group):
    """Uneven shards: the traced body reads each received slot by select(buf, 3, i), then its real rows (a cat of
    slices), so the pass splits Q off and opens the window (a copy of the whole buffer first kept the launch whole:
    no window, 2026-12-02, seen on the graph of Flux with uneven shards; a key mask reads the padded rows: unaffected)."""
    model = _UnevenUlysses()
    _, code, cap, logs = compile_and_get(model, (torch.randn(1, 9, DIM, generator=torch.Generator().manual_seed(4)),))
    assert cap.windows == [1], logs
    assert any("split ulysses_packed_start" in m for m in logs), logs
    launches = re.findall(r"= torch\.ops\.cp_ops\.(\w+)\.default\(", code)
    assert launches == ["ulysses_packed_start", "ulysses_packed_start", "ulysses_inverse_start"], launches
