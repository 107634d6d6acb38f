"""`cp-ops bound MODEL --worlds W[,W...]` (cp_ops.cli.bound): the zero-communication bound on one device over fake
groups of 2, 4 and 8 ranks, on the tiny configs (CPU): every side returns the full output shape, the bound is finite
and positive, the plain-attention stand-in computes what it claims, the weights are shared, and argument errors."""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import cp_ops

from cp_ops.cli import bound, bound_procs, bound_report, bound_sides
from cp_ops.cli.main import main
from cp_ops.cli.models import MODELS, build


def _args(model, **kw):
    spec = MODELS[model]
    f, h, w = spec.cpu_latent
    base = dict(model=model, config="tiny", checkpoint=None, layers=None, frames=f, height=h, width=w,
                text_tokens=16, batch=1, dtype="fp32", mode="auto", chunks=1, bound=[2, 4, 8],
                bound_compile=["eager"], cost=True, no_group1=False, profile=None, warmup=1, repeats=2, out=None,
                unwritten=False, steps=0, compare=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("model", ["wan", "flux", "qwenimage", "zimage", "ltx"])
def test_bound_tiny_fake_groups(model, tmp_path):
    """W = 4 and 8 on one CPU (the tiny configs' 4 heads: auto takes Ulysses at W=4, AGKV at W=8): one row per W,
    finite positive times and bound, cost = rank 0 - plain, the JSON written; every side's output had the full shape
    (run_bound raises otherwise); no process group left behind. flux/qwenimage split the text too (joint attention),
    qwenimage/zimage carry key masks (text, padding)."""
    out = tmp_path / "b.json"
    rows = bound.run_bound(_args(model, out=str(out), bound=[4, 8]), torch.device("cpu"))
    assert not dist.is_initialized()
    assert [r["world_size"] for r in rows] == [4, 8]
    assert [r["mode"] for r in rows] == ["ulysses", "agkv"]
    for r in rows:
        assert math.isfinite(r["bound_speedup"]) and r["bound_speedup"] > 0
        assert r["rank0_ms"] > 0 and r["one_gpu_ms"] <= min(r["diffusers_ms"], r["group1_ms"])
        assert r["one_gpu_from"] in ("diffusers", "group of 1")
        if r["one_gpu_from"] == "diffusers":
            assert r["one_gpu_ms"] == r["diffusers_ms"]
        # the fake collectives wrote real data (bound_fill), timed alone and taken out of rank 0's time
        assert r["fills"] > 0 and r["fill_ms"] >= 0 and r["rank0_ms"] == pytest.approx(r["rank0_raw_ms"] - r["fill_ms"])
        assert r["cp_ops_cost_ms"] == pytest.approx(r["rank0_raw_ms"] - r["plain_ms"])
        # the host's time to enqueue a forward: on CPU the call's wall time, so every side is host-bound
        for p in ("", "plain_", "diffusers_", "group1_"):
            assert r[p + "host_ms"] > 0 and r[p + "host_bound"] is True, (p, r)
        assert r["host_ms"] == pytest.approx(r["rank0_raw_ms"]) and r["plain_host_ms"] == pytest.approx(r["plain_ms"])
        spec = MODELS[model]
        layers = [spec.configs["tiny"][k] for k in spec.layer_keys]
        assert r["layers"] == (layers[0] if len(layers) == 1 else layers) and r["config"] == "tiny"
        assert r["mode"] == cp_ops.choose_mode("auto", spec.heads(spec.configs["tiny"]), r["world_size"])
    saved = json.loads(out.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["meta"]["tokens"] == rows[0]["tokens"]
    # every side's build, first call and one more forward, written as each side was built (a killed run keeps them)
    first = saved["first_calls"]["eager"]
    assert sorted(f["side"] for f in first) == sorted(
        ["diffusers", "group of 1"] + [f"{k} W{w}" for w in (4, 8) for k in ("cp_ops", "plain")])
    for f in first:
        assert f["build_s"] > 0 and f["first_call_s"] > 0 and f["second_call_ms"] > 0, f


def test_bound_reduced_depth_says_so():
    rows = bound.run_bound(_args("wan", layers=1, bound=[2], cost=False, no_group1=True, repeats=1),
                           torch.device("cpu"))
    assert rows[0]["config"] == "tiny (1 of 2 layers)" and "group1_ms" not in rows[0] and "plain_ms" not in rows[0]
    assert rows[0]["one_gpu_from"] == "diffusers"


@pytest.fixture
def fake_world_4():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def test_fake_groups_and_shared_copy(fake_world_4):
    groups = bound.fake_groups([1, 2, 4])
    assert {w: g.size() for w, g in groups.items()} == {1: 1, 2: 2, 4: 4}
    assert all(g.rank() == 0 for g in groups.values())
    with pytest.raises(RuntimeError, match="fake default process group of >= 8 ranks"):
        bound.fake_groups([8])
    model, _ = build(MODELS["wan"], "tiny", None, "cpu", torch.float32)
    copy = bound_sides.shared_copy(model)
    assert copy is not model and copy.blocks[0] is not model.blocks[0]
    assert all(a is b for a, b in zip(copy.parameters(), model.parameters()))
    from cp_ops.integrations.diffusers import parallelize

    parallelize(copy, groups[2], mode="agkv", transport="torch")
    assert getattr(model, "_cp_ops_group", None) is None  # the original stays unparallelized
    assert bound_sides.to_plain(copy, "agkv") == len(copy.blocks)
    with pytest.raises(RuntimeError, match="no attention processor"):
        bound_sides.to_plain(model, "agkv")


class _State:
    def __init__(self, world, totals):
        self.world, self.totals = world, totals

    def total(self, stream, where):
        return self.totals[stream]


@pytest.mark.parametrize("mode", ["agkv", "ulysses"])
def test_plain_attention_shapes_and_values(mode):
    """The stand-in attends what it says: AGKV = local Q against the local K/V repeated W times, cut to S (uneven:
    S = 2 * 5 + 1 over W = 4 ranks here, rank 0 holding 3); Ulysses = all S tokens, H / W heads, the output's first
    S_local tokens repeated over the heads; the key mask repeated like K. Fresh random inputs; output [B, S_local, H, D]."""
    from cp_ops.integrations.diffusers.dispatch import CPAttention

    w, b, s_local, h, d, total = 4, 2, 3, 8, 16, 11
    cp = CPAttention(_State(w, {"text": 4, "image": 7}), ("text", "image"), "test")
    plain = bound_sides.PlainAttention(cp, mode)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, s_local, h, d, generator=g) for _ in range(3))
    mask = torch.rand(b, s_local, generator=g) > 0.3
    mask[:, 0] = True
    out = plain(q, k, v, mask, 0.0, False, None)
    assert out.shape == (b, s_local, h, d) and torch.isfinite(out).all()

    def rep(x):
        return torch.cat([x] * w, dim=1)[:, :total]

    m = rep(mask)[:, None, None, :]
    if mode == "agkv":
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), rep(k).transpose(1, 2), rep(v).transpose(1, 2), attn_mask=m).transpose(1, 2)
    else:
        qs, ks, vs = (rep(x[:, :, : h // w]).transpose(1, 2) for x in (q, k, v))
        full = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=m).transpose(1, 2)
        ref = full[:, :s_local].repeat(1, 1, w, 1)
    torch.testing.assert_close(out, ref)


def test_parse_mode():
    assert bound_sides.parse_mode("regional+graphs") == ("regional", True)
    assert bound_sides.parse_mode("eager") == ("eager", False)
    assert bound_sides.parse_mode("eager+graphs") == ("eager", True)
    assert bound_sides.parse_mode("regional+capture") == ("regional", "forward")
    assert bound_sides.parse_mode("full+capture") == ("full", "forward")
    for text in ("eager", "eager+graphs", "regional", "regional+graphs", "regional+capture", "full+capture"):
        assert bound_sides.mode_name(*bound_sides.parse_mode(text)) == text


@pytest.mark.parametrize("bad", ["graphs", "regional+cuda", "fullgraph", "", "capture"])
def test_parse_mode_rejects(bad):
    with pytest.raises(ValueError, match="one of eager|regional|full"):
        bound_sides.parse_mode(bad)


def test_parse_mode_rejects_eager_capture():
    with pytest.raises(ValueError, match="eager\\+graphs already captures the whole eager forward; got 'eager\\+capture'"):
        bound_sides.parse_mode("eager+capture")


def test_graph_kinds_from_the_flags():
    from types import SimpleNamespace as N

    from cp_ops.cli._args import per_block_graphs, whole_capture

    cases = {(None, False): (False, False), (None, True): (False, True), (None, "forward"): (False, True),
             ("regional", False): (False, False), ("regional", True): (True, False),
             ("regional", "forward"): (False, True), ("full", "forward"): (False, True)}
    for (comp, graphs), want in cases.items():
        a = N(compile=comp, cuda_graphs=graphs)
        assert (per_block_graphs(a), whole_capture(a)) == want, (comp, graphs)


@pytest.mark.parametrize("extra, message", [
    (["--worlds", "0"], "--worlds takes CP world sizes >= 1"),
    (["--worlds", "2", "--compile-modes", "regional+graphs"], "needs CUDA"),
    (["--worlds", "2", "--compile-modes", "fast"], "a compile mode is one of"),
    (["--worlds", "2", "--compile-modes", "eager+capture"], "eager+graphs already captures"),
    (["--worlds", "3", "--mode", "ulysses"], "needs W=3 to divide the 4 heads"),
    (["--worlds", "2", "--no-overlap"], "--no-overlap applies to compiled modes; --compile-modes is ['eager']"),
    (["--worlds", "2", "--compile-workers", "2"], "--compile-workers applies to compiled modes"),
    (["--worlds", "2", "--compile-modes", "full", "--compile-workers", "-1"], "child processes >= 0; got -1"),
    (["--worlds", "2", "--compile-modes", "eager,regional", "--side-processes"],
     "--side-processes applies when every mode is compiled"),
    (["--worlds", "2", "--compile-modes", "regional", "--side-processes", "--compile-workers", "2"],
     "--side-processes does not take --compile-workers"),
    (["--worlds", "2", "--compile-modes", "regional", "--side-processes", "--steps", "2"],
     "--side-processes does not take --steps"),
])
def test_bound_argument_errors(extra, message, capsys):
    assert main(["bound", "flux", "--device", "cpu"] + extra) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra, now", [
    (["--bound", "2"], "cp-ops bound MODEL --worlds"),
    (["--cost"], "cp-ops bound MODEL --cost"),
    (["--side-processes"], "cp-ops bound MODEL --side-processes"),
])
def test_run_names_the_bound_command(extra, now, capsys):
    """cp-ops run no longer takes the bound's flags: argparse's error names the command that does."""
    with pytest.raises(SystemExit) as e:
        main(["run", "flux", "--device", "cpu"] + extra)
    assert e.value.code == 2 and now in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--cfg", "--transport", "--comm-dtype", "--mesh", "--nproc"])
def test_bound_does_not_take_the_ranks_flags(flag, capsys):
    """One process, fake groups: the flags of a real CP run are not cp-ops bound's (argparse names who takes them)."""
    with pytest.raises(SystemExit):
        main(["bound", "flux", "--worlds", "2", flag, "x"])
    err = capsys.readouterr().err
    assert re.search(rf"{flag} is an option of [^;)]*cp-ops run", err), err


def test_bound_cli_end_to_end(tmp_path, capsys):
    """`cp-ops bound wan --worlds 2 --device cpu` through main(): one process, the table printed, the JSON written."""
    out = tmp_path / "b.json"
    assert main(["bound", "wan", "--device", "cpu", "--worlds", "2", "--repeats", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "zero-communication bound" in text and "eager" in text
    # without --cost no empty 'cp_ops cost' column, a pointer to the flag instead; on CPU, what the numbers are
    assert "cp_ops cost" not in text and "--cost adds cp_ops' own cost" in text, text
    assert "CPU: a functional check, not a performance claim" in text, text
    assert json.loads(out.read_text())["rows"][0]["world_size"] == 2
    assert not dist.is_initialized()


#: the driver of test_bound_compile_workers_then_side_processes: `cp-ops bound` runs, one after another, in one fresh
#: interpreter. Its top level runs in every child the tool spawns too (multiprocessing imports a script parent's main
#: file as __mp_main__ before the child's work), so the parent and every child compile alike with Inductor falling
#: back to ATen for every op: Inductor and its FX graph cache as usual, without its C++ kernels' compiles (seconds
#: each, and what the tool's orchestration does not depend on). No global named `torch` at its top: with one, the
#: spawned children's FX graph cache keys differed from the parent's (torch 2.13), and every compile missed.
_DRIVER = """
import sys
import torch._inductor.config as inductor_config
inductor_config.fallback_by_default = True
if __name__ == "__main__":
    import json
    from cp_ops.cli.main import main
    for argv in json.loads(sys.argv[1]):
        print("=== run", flush=True)
        if main(argv) != 0:
            sys.exit(1)
"""


def test_bound_compile_workers_then_side_processes(tmp_path):
    """A fresh process, as the CLI runs (the compiled graphs name the fake groups, whose names count the groups a
    process made before), on one cold on-disk cache, runs two `cp-ops bound` commands:

    1. --compile-workers 2: each side of the compiled mode is compiled first in a child process (spawned, its own
       model) into the shared on-disk caches; the run's own compiles of the same sides then all hit Inductor's FX
       graph cache (it says so), and the rows are as without it.
    2. --side-processes, on the caches run 1 filled (what it checks does not depend on them): each side of the
       compiled mode is built, compiled and timed in its own spawned process on the parent's weights; the parent's
       rounds time them through their pipes, and the rows carry what the processes measured (the fake collectives'
       writes counted there, the outputs checked here).

    Both in one interpreter (run 2's parent compiles nothing; its children are fresh), Inductor without C++ kernels
    (:data:`_DRIVER`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    # a cold cache; Inductor's compile in-process (no pool of compile workers to start in each of the processes)
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), TORCHINDUCTOR_COMPILE_THREADS="1",
               PYTHONPATH=os.pathsep.join(sys.path))
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER)
    out = tmp_path / "sp.json"
    common = ["bound", "wan", "--device", "cpu", "--layers", "1", "--worlds", "2", "--compile-modes", "regional",
              "--no-group1"]
    runs = [common + ["--repeats", "1", "--warmup", "0", "--compile-workers", "2"],
            common + ["--repeats", "2", "--warmup", "1", "--side-processes", "--out", str(out)]]
    r = subprocess.run([sys.executable, str(driver), json.dumps(runs)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    _, text, text2 = r.stdout.split("=== run\n")
    assert "precompiling 2 sides in 2 child processes" in text, text
    assert "[precompile] [regional] diffusers:" in text and "[precompile] [regional] cp_ops W2:" in text, text
    assert "failed" not in text, text
    assert "[regional] Inductor's FX graph cache: 2 hits, 0 misses; AOTAutograd's: 2 hits, 0 misses" in text, text
    assert re.search(r"regional\s+2\s+agkv", text), text

    text = text2
    assert "[regional] 2 sides in their own processes (--side-processes)" in text, text
    for side in ("diffusers", "cp_ops W2"):
        assert f"[regional] {side}: built in" in text and "(in its process, beside the others' compiles)" in text
    d = json.loads(out.read_text())
    row, = d["rows"]
    assert row["world_size"] == 2 and row["compile"] == "regional" and row["mode"] == "agkv"
    assert row["fills"] > 0 and row["fill_ms"] > 0  # AGKV's gathers written in the side's process, replayed there
    assert len(row["rank0_samples"]) == 2 and all(t > 0 for t in row["rank0_samples"])
    assert row["bound_speedup"] > 0 and row["diffusers_host_ms"] > 0
    assert "its own process" in d["meta"]["side_processes"]
    assert {c["side"] for c in d["first_calls"]["regional"]} == {"diffusers", "cp_ops W2"}


def test_side_process_failures_are_reported(monkeypatch):
    """A side's process that reports an error, dies without answering, or does not answer in time: the parent's wait
    raises naming the side (the mode becomes a failed row), never waits unbounded; one that does not end when asked
    is killed after the grace period (1 s here, not the tool's 10 s). The children are forked (what is checked is the
    parent's wait; the spawned side processes run in test_bound_compile_workers_then_side_processes): a spawned child
    would import torch first, seconds each."""
    import multiprocessing
    import signal

    monkeypatch.setattr(bound_procs, "STOP_GRACE_S", 1.0)

    ctx = multiprocessing.get_context("fork")

    def side(target, args):
        s = bound_sides.Side("cp_ops W2", "cp", 2)
        s.conn, theirs = ctx.Pipe()
        s.proc = ctx.Process(target=target, args=args(theirs), daemon=True)
        s.proc.start()
        return s, theirs  # the caller closes its copy of the child's end (kept open: a child silent, not gone)

    # run_bound in the child fails on its (empty) arguments: the exception comes back as the side's error
    s, theirs = side(bound_procs._serve_side, lambda c: ({}, "cpu", "regional", "cp_ops W2", c, None, None,
                                                         bound.run_bound))
    theirs.close()
    with pytest.raises(RuntimeError, match=r"side 'cp_ops W2' failed in its process: AttributeError"):
        bound_procs._recv(s, 120)
    bound_procs.stop_sides([s])
    s, theirs = side(os._exit, lambda c: (3,))  # dies at once; this process still holds the child's end
    with pytest.raises(RuntimeError, match=r"its process ended \(exit code 3\) without answering"):
        bound_procs._recv(s, 120)
    bound_procs.stop_sides([s])
    theirs.close()
    s, theirs = side(os._exit, lambda c: (4,))  # dies with every copy of its end closed: the pipe's end of file
    theirs.close()
    with pytest.raises(RuntimeError, match=r"its process ended \(exit code 4\) without answering"):
        bound_procs._recv(s, 120)
    s.proc.join(5)  # a request to a process already gone: a broken pipe, named by the side
    with pytest.raises(RuntimeError, match=r"side 'cp_ops W2': its process ended \(exit code 4\) before this"):
        bound_procs._ask(s, ("time", 0, 1))
    bound_procs.stop_sides([s])
    s, theirs = side(time.sleep, lambda c: (60,))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not answer in 1 s"):
        bound_procs._recv(s, 1)
    assert time.monotonic() - t0 < 30
    proc, t0 = s.proc, time.monotonic()
    bound_procs.stop_sides([s])  # asked to stop, still asleep after the grace period: killed
    assert 1.0 <= time.monotonic() - t0 < 30 and proc.exitcode == -signal.SIGKILL, proc.exitcode
    theirs.close()
    assert s.proc is None and s.conn is None


def test_side_killed_with_a_request_unread_is_named():
    """A side's process killed while a request sits unread in its pipe: the parent's wait for the answer raises naming
    the side and its exit code (the socket's reset is not a bare ConnectionResetError)."""
    import multiprocessing
    import signal

    ctx = multiprocessing.get_context("fork")  # the child holds its end of the pipe (inherited) and never reads it
    s = bound_sides.Side("cp_ops W4", "cp", 4)
    s.conn, theirs = ctx.Pipe()
    s.proc = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    s.proc.start()
    theirs.close()
    s.conn.send(("time", 0, 1))  # never read: the process sleeps
    s.proc.kill()
    s.proc.join(10)
    with pytest.raises(RuntimeError, match=rf"side 'cp_ops W4': its process ended \(exit code -{int(signal.SIGKILL)}\) "
                                           "without answering"):
        bound_procs._recv(s, 30)
    bound_procs.stop_sides([s])


def test_config_label_names_reduced_depth():
    from cp_ops.cli.models import config_label

    spec = MODELS["flux"]
    assert config_label(spec, "dev", spec.config("dev")) == "dev"
    assert config_label(spec, "dev", spec.config("dev", 2)) == "dev (2+2 of 19+38 layers)"
    assert config_label(spec, "checkpoint", {"num_layers": 3}) == "checkpoint"


def test_bound_table_cost_column_only_with_cost(capsys):
    """print_table: the 'cp_ops cost' column and its legend where a row has the --cost measurement (was: always the
    header, an empty column without --cost); a GPU run prints no CPU note."""
    from cp_ops.cli.bound_report import print_table

    row = dict(compile=None, cuda_graphs=False, world_size=2, mode="agkv", one_gpu_ms=10.0, one_gpu_from="diffusers",
               rank0_ms=5.5, fill_ms=0.1, bound_speedup=1.82)
    meta = dict(cls="FluxTransformer2DModel", config="dev", tokens=4096, chunks=1, gpu="NVIDIA H200")
    print_table([dict(row, cp_ops_cost_ms=0.25, cp_ops_cost_pct=4.5)], meta)
    text = capsys.readouterr().out
    header, line = text.splitlines()[2:4]
    assert header.rstrip().endswith("cp_ops cost") and line.rstrip().endswith("0.25 ms   4.5%"), text
    assert "cp_ops cost = rank 0 minus" in text and "CPU:" not in text
    print_table([row], meta)
    text = capsys.readouterr().out
    header, line = text.splitlines()[2:4]
    assert header.rstrip().endswith("bound") and line.rstrip().endswith("1.82x"), text


def test_bound_no_overlap_reaches_the_compiled_sides(capsys):
    """`--compile-modes eager,regional --no-overlap`: the compiled sides compile without the overlap pass and the
    table's title says so."""
    for extra in (["--compile-modes", "regional"], ["--compile-modes", "eager,regional"]):
        seen = {}
        orig = bound.run_bound

        def fake(args, device):
            seen["margs"] = bound._mode_args(args, "regional", False)
            return []

        bound.run_bound = fake
        try:
            assert main(["bound", "flux", "--device", "cpu", "--worlds", "2", "--no-overlap"] + extra) == 0
        finally:
            bound.run_bound = orig
        assert seen["margs"].no_overlap is True, (extra, seen)
    bound_report.print_table([], dict(cls="FluxTransformer2DModel", config="tiny", tokens=64, chunks=1, overlap_pass=False))
    assert "compiled without the overlap pass (--no-overlap)" in capsys.readouterr().out


def test_bound_table_host_column_marks_host_bound_rows(capsys):
    """print_table: with host times, a 'host ms' column for rank 0 (and, with --cost, the plain side's) where a
    host-bound side (host >= HOST_BOUND x its measured time) carries '*', with the legend; none without host times."""
    from cp_ops.cli.bound_sides import HOST_BOUND
    from cp_ops.cli.bound_report import print_table

    row = dict(compile="regional", cuda_graphs=False, world_size=4, mode="ulysses", one_gpu_ms=128.0,
               one_gpu_from="diffusers", rank0_ms=80.9, fill_ms=0.6, bound_speedup=1.58, cp_ops_cost_ms=40.1,
               cp_ops_cost_pct=49.2, plain_ms=41.4, host_ms=80.0, host_bound=True, plain_host_ms=30.0,
               plain_host_bound=False)
    meta = dict(cls="FluxTransformer2DModel", config="dev", tokens=4096, chunks=1, gpu="NVIDIA H200")
    print_table([row], meta)
    text = capsys.readouterr().out
    header, line = text.splitlines()[2:4]
    assert header.rstrip().endswith("cp_ops cost  plain ms plain host"), header
    assert "80.00*" in line and line.rstrip().endswith("41.40     30.00"), line
    assert f"host-bound: host >= {HOST_BOUND:g} x" in text and "CPU: host = wall" not in text
    no_host = {k: v for k, v in row.items() if "host" not in k}
    print_table([no_host], meta)
    text = capsys.readouterr().out
    assert "host ms" not in text.splitlines()[2] and "host-bound" not in text


def test_side_host_bound_threshold():
    """Side.host_bound: host >= HOST_BOUND x the measured median; None before any host sample."""
    s = bound_sides.Side("cp_ops W4", "cp", 4, samples=[10.0, 10.0, 10.0])
    assert s.host_ms is None and s.host_bound is None
    s.host_samples = [bound_sides.HOST_BOUND * 10.0 - 0.01] * 3
    assert s.host_bound is False
    s.host_samples = [bound_sides.HOST_BOUND * 10.0] * 3
    assert s.host_bound is True and s.host_ms == pytest.approx(9.0)


def test_samples_ms_host_times_on_cpu():
    """cp_ops.timing.samples_ms(host=list): one host time per run; on CPU the run's wall time itself."""
    import time

    from cp_ops.timing import samples_ms

    host = []
    t = samples_ms(lambda: time.sleep(0.002), torch.device("cpu"), 1, 3, host)
    assert len(host) == 3 and host == t and min(host) >= 2.0


def test_bound_registers_the_cp_ops_backend_before_any_side(monkeypatch):
    """run_bound registers diffusers' attention backend 'cp_ops' before the first side is built: registered by the
    first parallelize (after the diffusers side compiled), it changed the registry that side's compiled blocks guard
    on, and the side compiled again at its first timed call (seen with TORCH_LOGS=recompiles, 2026-12-02)."""
    from cp_ops.integrations.diffusers import _private

    monkeypatch.delitem(_private._REGISTERED, "member", raising=False)
    seen = []

    def prepare(side, *a, **k):
        seen.append((side.name, "member" in _private._REGISTERED))
        raise RuntimeError("stop here")

    monkeypatch.setattr(bound, "_prepare", prepare)
    rows = bound.run_bound(_args("flux", bound=[2], cost=False, no_group1=True), torch.device("cpu"))
    assert seen == [("diffusers", True)] and "stop here" in rows[0]["skipped"]


def test_results_table_host_column():
    """The results' Markdown table (cp_ops.cli.bound_report.results_table): a 'host ms' column (rank 0 / plain, '*'
    host-bound) where any row has host times;
    none for older rows."""
    from cp_ops.cli.bound_report import results_table as table

    row = dict(model="flux", config="dev", tokens=4096, compile="regional", cuda_graphs=False, world_size=4,
               mode="ulysses", one_gpu_ms=128.1, one_gpu_from="diffusers", rank0_ms=80.9, fill_ms=0.6,
               bound_speedup=1.58, rank0_samples=[80.0, 82.0])
    old = table([row])
    assert "host ms" not in old and old.splitlines()[2].count("|") == 9
    new = table([dict(row, host_ms=80.4, host_bound=True, plain_host_ms=30.2, plain_host_bound=False)])
    assert "host ms rank 0 / plain" in new and new.splitlines()[2].rstrip().endswith("| 80.4* / 30.2 |"), new
    # a row written without --cost holds cp_ops_cost_ms: null (an empty cell, not a format error)
    assert table([dict(row, cp_ops_cost_ms=None, cp_ops_cost_pct=None)]).splitlines()[2].endswith("| 1.58x |  |")


@pytest.mark.parametrize("flag, text", [("--compile-modes", ","), ("--compile-modes", ""), ("--worlds", " , ")])
def test_an_empty_list_is_refused(flag, text):
    """A comma-separated option given no item is an argument error, not the default (it ran the defaults before)."""
    from cp_ops.cli._args import csv

    parse = csv(str, "compile modes") if flag == "--compile-modes" else csv(int, "CP world sizes")
    with pytest.raises(argparse.ArgumentTypeError, match="at least one; got " + re.escape(repr(text))):
        parse(text)
    assert parse("eager,regional") == ["eager", "regional"] if flag == "--compile-modes" else parse("2,4,") == [2, 4]


def test_a_bad_list_item_is_named():
    """A comma-separated option's bad item is named with the whole text (not int()'s own words); a rule the item's
    parser states is kept in the message."""
    from cp_ops.cli._args import chunks, csv

    with pytest.raises(argparse.ArgumentTypeError, match=r"list of CP world sizes; 'x' in '2,x' is not one$"):
        csv(int, "CP world sizes")("2,x")
    with pytest.raises(argparse.ArgumentTypeError, match=r"'0' in '2,0' is not one \(chunks must be >= 1 or auto; got 0\)"):
        csv(chunks, "chunks")("2,0")


def test_kernel_summary_device_and_host_time():
    """--profile's per-side summary: on CUDA the device time of kernels by category (host ops' device time is their
    kernels', not counted twice) and the host's self CPU time of every event but its waits for the device, largest
    first (µs in, ms out)."""
    from types import SimpleNamespace as E

    from cp_ops.cli.bound_report import kernel_summary

    events = [E(key="aten::addmm", self_cpu_time_total=300.0, self_device_time_total=900.0, count=2),
              E(key="nvjet_sm90_tst_128x256", self_cpu_time_total=0.0, self_device_time_total=900.0, count=2),
              E(key="cudnn_generated_fort_native_sdpa", self_cpu_time_total=0.0, self_device_time_total=400.0, count=1),
              E(key="cp_ops::ulysses_packed_start", self_cpu_time_total=700.0, self_device_time_total=0.0, count=4),
              E(key="cudaLaunchKernel", self_cpu_time_total=50.0, self_device_time_total=0.0, count=9),
              E(key="cudaDeviceSynchronize", self_cpu_time_total=9000.0, self_device_time_total=0.0, count=1)]
    s = kernel_summary(events, cuda=True)
    assert s["by_category"] == {"gemm": 0.9, "attention": 0.4} and abs(s["busy_ms"] - 1.3) < 1e-9
    assert [r[0] for r in s["top"]] == ["nvjet_sm90_tst_128x256", "cudnn_generated_fort_native_sdpa"]
    assert abs(s["host_ms"] - 1.05) < 1e-9
    assert s["host_top"] == [["cp_ops::ulysses_packed_start", 0.7, 4], ["aten::addmm", 0.3, 2],
                             ["cudaLaunchKernel", 0.05, 9]]
    cpu = kernel_summary(events[:-1], cuda=False)  # CPU: every op's self CPU time is its busy time
    assert abs(cpu["busy_ms"] - 1.05) < 1e-9 and cpu["by_category"]["gemm"] == 0.3
