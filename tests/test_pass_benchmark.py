"""benchmarks/overlap_block.py: its trace reader and code reader on known inputs, and its CPU smoke run."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "overlap_block.py")


def _load():
    spec = importlib.util.spec_from_file_location("overlap_block", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # importable by name, as Dynamo looks up the functions it traces
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ob():
    return _load()


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_overlap_fraction_gpu_trace(ob, tmp_path):
    events = [
        _kernel("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 0, 100),
        _kernel("sm90_xmma_gemm_bf16bf16", 50, 100),  # overlaps 50
        _kernel("triton_red_fused_mean_pow_rsqrt_0", 160, 10),  # no comm at that time
        _kernel("ncclDevKernel_SendRecv(ncclDevComm*)", 200, 100),
        _kernel("triton_poi_fused_stack_1", 250, 10),  # overlaps 10
        _kernel("triton_poi_fused_mul_2", 255, 10),  # overlaps 5 more (union with the previous)
        _kernel("cudnn_attention_fwd", 280, 40),  # overlaps 20
        _kernel("nccl:all_gather", 0, 1000, cat="user_annotation"),  # CPU-side annotation: ignored on GPU
        _kernel("(anonymous namespace)::copy2d_kernel(CopyBatch, unsigned long const*)", 400, 20),  # fast transport
        _kernel("Memcpy PtoP (Device -> Device)", 430, 10, cat="gpu_memcpy"),  # fast transport, copy engine
        _kernel("triton_poi_fused_add_4", 425, 10),  # overlaps the memcpy by 5, not the copy kernel
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    ov = ob.overlap_fraction(str(path))
    assert ov["comm_ms"] == pytest.approx(0.23)
    assert ov["overlap_ms"] == pytest.approx(0.090)
    assert ov["fraction"] == pytest.approx(90 / 230)


def test_overlap_fraction_without_comm_is_none(ob, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_kernel("triton_poi_fused_add_0", 0, 5)]}))
    assert ob.overlap_fraction(str(path))["fraction"] is None


def test_window_kernels_reads_generated_code(ob):
    code = """
        extern_kernels.mm(buf0, arg1_1, out=buf1)
        buf7 = torch.ops.cp_ops.agkv_gather_start.default(buf6, buf5, 2, '0', 'torch')
        assert_size_stride(buf8, (1, 32, 4, 16), (2048, 64, 16, 1), 'torch.ops.cp_ops.agkv_gather_start.default')
        extern_kernels.mm(buf0, arg2_1, out=buf10)
        triton_red_fused_mean_pow_rsqrt_2.run(buf10, buf11)
        triton_poi_fused_stack_3.run(buf11, buf12)
        torch.ops._c10d_functional.wait_tensor.default(buf8)
        torch.ops._c10d_functional.wait_tensor.default(buf9)
        buf20 = torch.ops.aten._scaled_dot_product_cudnn_attention.default(buf12, buf8, buf9)
    """
    assert ob.window_kernels(code) == [["extern_kernels.mm", "triton_red_fused_mean_pow_rsqrt_2", "triton_poi_fused_stack_3"]]


def _smoke_rank(rank, world_size, args, stdout_path):
    """A rank of the smoke run: the script's own rank body, its printing (rank 0's table) kept in a file. Inductor
    falls back to ATen for every op (its code then calls ATen ops where it would call its own C++ kernels): the
    variants compile, run and are read back as usual, without the kernels' C++ compiles (seconds each)."""
    import contextlib

    import torch
    import torch._inductor.config

    with open(stdout_path if rank == 0 else os.devnull, "w") as f, contextlib.redirect_stdout(f), \
            torch._inductor.config.patch(fallback_by_default=True):
        _load().run_rank(rank, world_size, torch.device("cpu"), args)


def test_cpu_smoke_run(ob, tmp_path, monkeypatch):
    """The script's main() on CPU, end to end: its arguments and CPU defaults, every variant compiled and timed, the
    profiles read back, the table, the JSON and the plot. Its ranks are the tests' forked gloo ranks
    (dist_util.run_ranks) instead of the script's spawned ones (cp_ops.cli.launch.launch, which test_cli's
    ``cp-ops bench`` runs go through): three interpreter starts fewer."""
    from dist_util import run_ranks

    out = tmp_path / "out"
    stdout = tmp_path / "stdout.txt"
    launched = []

    def launch(fn, nproc, device, args):
        assert fn is ob.run_rank and device == "cpu", (fn, device)
        launched.append(nproc)
        run_ranks(_smoke_rank, nproc, args, str(stdout))

    monkeypatch.setattr(ob, "launch", launch)
    # one mode and one static S keep CI's time: the script's AGKV path is the same code, the pass's AGKV windows are
    # tested by test_pass_graph / test_pass_correctness, and the pass under a dynamic S by test_pass_correctness
    # (the script's --dynamic default only marks S dynamic: one S here would compile once either way)
    assert ob.main(["--device", "cpu", "--out", str(out), "--seqs", "64", "--warmup", "1", "--repeats", "2",
                    "--no-dynamic", "--profile-iters", "1", "--modes", "ulysses"]) == 0
    assert launched == [2]
    text = stdout.read_text()
    assert "exposed CP" in text, text  # the table header
    res = json.loads((out / "overlap_block.json").read_text())
    assert res["complete"] and not res["skipped"]
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"ulysses"}
    for mode, r in rows.items():
        assert "error" not in r, r
        for key in ("single_ms", "cp_ms", "cp_pass_ms", "copy_ms", "exposed_cp_pass_pct", "speedup_cp_pass"):
            assert r[key] is not None and r[key] >= 0, (mode, key, r)
        # The generated code: nothing between launch and wait without the pass; the Q GEMM and the Q norm/RoPE
        # kernel with it (Ulysses: also the Q launch).
        assert r["cp_kernels_in_window"] == [0], r
        assert r["cp_pass_kernels_in_window"][0] >= (3 if mode == "ulysses" else 2), r
        assert r["max_abs_diff_pass_vs_nopass"] == 0.0, r
        assert r["cp_pass_overlap_frac"] is None or 0.0 <= r["cp_pass_overlap_frac"] <= 1.0
    assert (out / "overlap_block.png").exists()
