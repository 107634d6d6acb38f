"""What the CLI's output and files promise (issue 12 items 1, 7, 8, 9): the single-device baseline runs alone,
oversubscribed cores are warned about, results go only where ``--out`` says (checked before the run), the
progress bar stays out of logs, and under torchrun a bad argument is one line from rank 0 with exit code 2."""

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time

import pytest

from cli_util import run_cli
from dist_util import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--device", "cpu", "--seqs", "64", "--heads", "2", "--head-dim", "8", "--modes", "agkv", "--warmup", "0",
         "--repeats", "2"]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("CP_OPS_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def _bench_rank(rank, world_size, out_dir):
    """run_bench with local_attention instrumented: when each rank calls it, and what rank 0 prints."""
    import torch

    from cp_ops.cli import bench

    calls = []
    real = bench.local_attention

    def timed(*a, **k):
        t0 = time.time()
        r = real(*a, **k)
        calls.append((t0, time.time()))
        return r

    bench.local_attention = timed
    bench.available_cores = lambda: 1  # pretend one core: 2 ranks x 1 thread oversubscribe it
    args = argparse.Namespace(dtype="fp32", batch=1, heads=2, head_dim=8, seqs=[64, 128], modes=["agkv"],
                              transports=["torch"], warmup=1, repeats=3, calls=2, chunks=[1], progress=False, out=None,
                              plot=None)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        bench.run_bench(rank, world_size, torch.device("cpu"), args)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"calls": calls, "stdout": buf.getvalue()}, f)


def test_single_device_baseline_runs_alone(tmp_path):
    run_ranks(_bench_rank, 2, str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # rank 0 per S: the reference, warm-up (full, share), 3 rounds of (full x 2 calls, share x 2 calls), latency x 3
    per_s = 1 + 2 + 3 * (2 + 2) + 3
    assert len(r0["calls"]) == 2 * per_s and len(r1["calls"]) == 2  # rank 1: only the untimed reference per S
    for i in range(2):  # per S: rank 1's reference is over before rank 0's timed runs begin (no contention)
        first_timed = r0["calls"][i * per_s + 1][0]
        assert r1["calls"][i][1] <= first_timed, (r1["calls"][i], first_timed)
    assert "warning: 2 ranks x 1 thread(s) = 2 > 1 cores here" in r0["stdout"]
    assert "warning" not in r1["stdout"]
    assert "rounds interleaved with the CP samples" in r0["stdout"]


def test_no_out_writes_nothing_and_progress_only_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    p = run_cli(["bench", *SMALL, "--progress"], monkeypatch, capsys)  # the ranks' output kept as bytes wrote it
    assert p.returncode == 0, p.stderr[-2000:]
    assert "(no JSON written: --out PATH saves the results)" in p.stdout
    assert os.listdir(tmp_path) == []  # no cp_ops_results/ in the working directory
    assert "\r" in p.stderr and "cp-ops bench" in p.stderr  # --progress shows the bar off a terminal too
    assert "S=64 round 2/2 of 1 case(s)" in p.stderr  # the interleaved rounds show, not only finished cases
    # (without --progress, no bar off a terminal: tests/test_cli.py::test_bench_cpu_default)


@pytest.mark.parametrize("case", ["under_a_file", "a_directory"])
def test_out_checked_before_the_run(tmp_path, monkeypatch, capsys, case):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out, message = {"under_a_file": (blocker / "bench.json", f"--out {blocker / 'bench.json'}: cannot write under {blocker}"),
                    "a_directory": (tmp_path, f"--out {tmp_path} is a directory; give a file path")}[case]
    t = time.perf_counter()
    p = run_cli(["bench", *SMALL, "--out", str(out)], monkeypatch, capsys)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [f"cp-ops: {message}"], p.stderr
    assert "cp-ops bench —" not in p.stdout  # no rank ran
    assert time.perf_counter() - t < 30


def test_plot_checked_before_the_run(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    p = run_cli(["bench", *SMALL, "--plot", str(blocker / "x.png"), "--out", ""], monkeypatch, capsys)
    assert p.returncode == 2 and "--plot" in p.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_out_check_tries_the_write():
    """/proc takes no new files, yet os.access says writable to root: the check tries the write, before the run."""
    from cp_ops.cli._args import UsageError, check_out

    with pytest.raises(UsageError, match=r"^--out /proc/cp_ops_x\.json: cannot write under /proc \("):
        check_out("/proc/cp_ops_x.json", "--out")


def test_out_overwrite_is_announced(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.json"
    out.write_text("{}")
    p = run_cli(["bench", *SMALL, "--out", str(out)], monkeypatch, capsys)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"cp-ops: --out {out} exists; it will be overwritten" in p.stdout
    assert f"wrote {out} (replaced the file that was there)" in p.stdout
    assert json.loads(out.read_text())["rows"][0]["S"] == 64


def test_out_creates_missing_folders(tmp_path, monkeypatch, capsys):
    """--out into folders that do not exist yet: they are created (README: 'missing folders created')."""
    out = tmp_path / "new" / "sub" / "bench.json"
    p = run_cli(["bench", *SMALL, "--out", str(out)], monkeypatch, capsys)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"wrote {out}" in p.stdout and json.loads(out.read_text())["rows"][0]["S"] == 64


def _torchrun(*args):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "cp_ops",
                           *args], capture_output=True, text=True, timeout=180, env=_env(), cwd=ROOT)


def test_torchrun_bad_argument_is_one_line_from_rank_0():
    p = _torchrun("bench", *SMALL[:2], "--seqs", "64,65")
    text = p.stdout + p.stderr
    msg = "cp-ops: bench: every S in --seqs must be a positive multiple of the CP world size 2; got [65]"
    assert text.count(msg) == 1 and text.count("cp-ops:") == 1, text
    assert "cp_ops/" not in text and "cp_ops\\" not in text  # no traceback from cp_ops (torchrun adds its summary)
    assert "exitcode  : 2" in text  # rank 0 exited 2: torchrun names it the root cause
    p = _torchrun("bench", "--bogus")
    text = p.stdout + p.stderr
    assert text.count("cp-ops bench: error: unrecognized arguments: --bogus") == 1 and "exitcode  : 2" in text, text


def test_bench_graph_cell_without_single_device_graph():
    """`--graphs`: when the 1-device capture failed (rank 0 alone, now caught so the other ranks are not left at
    the barrier), the CP graph time is still shown, the speedup as '-'."""
    from cp_ops.cli import bench

    assert bench._graph_cell({"graph_cp_ms": 1.25, "graph_speedup": None}) == "1.250 (-)"
    assert bench._graph_cell({"graph_cp_ms": 1.25, "graph_speedup": 2.0}) == "1.250 (2.00x)"
    assert bench._graph_cell({"graph_skipped": "x"}) == "failed" and bench._graph_cell({}) == "-"


def test_plot_ticks_are_the_measured_seqs_and_a_one_point_bound_shows(tmp_path, monkeypatch):
    """bench --plot: x ticks at the measured S (75600 is no power of 2), and a mode's bound at a single S (the auto
    row picked Ulysses only there) is drawn as a visible point, not an invisible one-point line."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from cp_ops.cli.bench import plot

    saved = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (saved.append(self), real_savefig(self, *a, **k)))

    def row(s, mode, speedup, requested="agkv"):
        return dict(S=s, mode=mode, requested_mode=requested, requested_chunks=1, transport="torch",
                    speedup=speedup, recv_bytes=1, bound_speedup=speedup + 0.1)

    rows = [row(16384, "agkv", 1.7), row(75600, "agkv", 1.9), row(75600, "ulysses", 1.95, requested="auto")]
    plot(rows, dict(world_size=2, dtype="bf16", H=40, D=128), str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").stat().st_size > 1000
    ax = saved[0].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16384", "75600"]
    bound_u = next(ln for ln in ax.get_lines() if ln.get_label() == "bound ulysses")
    assert len(bound_u.get_xdata()) == 1 and bound_u.get_marker() not in (None, "None", "", " ")


def test_run_width_defaults_to_height():
    """cp-ops run --help: '--width (default as --height)'; --height 8 alone gave a width of 16 (the CPU default)."""
    pytest.importorskip("diffusers")
    from cp_ops.cli.main import build_parser
    from cp_ops.cli.run_args import check as _check_run

    for argv, hw in [(["--height", "8"], (8, 8)), ([], (16, 16)), (["--height", "8", "--width", "4"], (8, 4))]:
        args = build_parser().parse_args(["run", "wan", *argv])
        _check_run(args, "cpu", 2)
        assert (args.height, args.width) == hw, (argv, args.height, args.width)


def test_bench_default_seqs_on_a_width_they_do_not_fit():
    """cp-ops bench --nproc 3 (CPU default S 512,1024,2048): the error says the S are the defaults and offers
    multiples of 3, instead of blaming a --seqs the user never gave."""
    from cp_ops import config
    from cp_ops.cli._args import UsageError
    from cp_ops.cli.bench_args import check as _check_bench
    from cp_ops.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--nproc", "3"])
    with pytest.raises(UsageError, match=r"^bench: the default S \[512, 1024, 2048\] are not all multiples of the CP "
                                         r"world size 3; give --seqs, e\.g\. --seqs 510,1023,2046$"):
        _check_bench(args, "cpu", 3, config.settings)
    args = build_parser().parse_args(["bench", "--nproc", "3", "--seqs", "512"])
    with pytest.raises(UsageError, match=r"every S in --seqs must be a positive multiple .* 3; got \[512\]"):
        _check_bench(args, "cpu", 3, config.settings)


@pytest.mark.parametrize("value,ok", [("e4m3", True), ("e5m2:qvo", True), ("fp8", True), ("none", True),
                                      ("e7m1", False), ("e4m3:qz", False), ("e4m3:", False)])
def test_comm_dtype_checked_alike_by_bench_and_run(value, ok):
    """--comm-dtype: bench and run take the forms cp_ops.comm_dtype.parse takes (one check, cli._args), and name
    them on a bad value; bench checked nothing before (a bad value failed inside the ranks), run had its own regex."""
    import importlib.util

    from cp_ops import config
    from cp_ops.cli._args import UsageError
    from cp_ops.cli.bench_args import check as _check_bench
    from cp_ops.cli.main import build_parser
    from cp_ops.cli.run_args import check as _check_run

    cases = [(build_parser().parse_args(["bench", "--comm-dtype", value]), lambda a: _check_bench(a, "cpu", 2,
                                                                                                   config.settings))]
    if importlib.util.find_spec("diffusers") is not None:
        cases.append((build_parser().parse_args(["run", "wan", "--comm-dtype", value]), lambda a: _check_run(a, "cpu", 2)))
    for args, check in cases:
        if ok:
            check(args)
        else:
            with pytest.raises(UsageError, match=rf"--comm-dtype takes none, e4m3, e5m2 or FMT:LETTERS .*got '{value}'"):
                check(args)


@pytest.mark.parametrize("value,canonical", [("fp8", "e4m3"), ("E4M3", "e4m3"), ("e4m3fn", "e4m3"),
                                              ("torch.float8_e4m3fn", "e4m3"), ("float8_e5m2:qvo", "e5m2:qvo"),
                                              ("fp8_e4m3:vok", "e4m3:kvo"), ("none", "none"), ("bf16", "none")])
def test_comm_dtype_aliases_become_one_spelling(value, canonical):
    """--comm-dtype fp8 / E4M3 / e4m3fn / torch's names: accepted (a user writes them) and rewritten to the canonical
    spelling the header, the JSON and the --mesh check read (was: the header said 'comm_dtype=bf16 (FP8 on the wire:
    not bitwise)' for bf16, which sends the input dtype, and --mesh refused bf16 as FP8; e4m3fn was refused)."""
    from cp_ops import config
    from cp_ops.cli._args import UsageError
    from cp_ops.cli.bench_args import check as _check_bench
    from cp_ops.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--comm-dtype", value, "--dtype", "bf16"])
    _check_bench(args, "cpu", 2, config.settings)
    assert args.comm_dtype == canonical
    args = build_parser().parse_args(["bench", "--nproc", "4", "--mesh", "2x2", "--comm-dtype", value, "--dtype", "bf16"])
    if canonical == "none":
        _check_bench(args, "cpu", 4, config.settings)
        assert args.mesh == (2, 2)
    else:
        with pytest.raises(UsageError, match=rf"--mesh rows run without FP8 .*--comm-dtype {canonical}: drop one"):
            _check_bench(args, "cpu", 4, config.settings)


def test_comm_dtype_bf16_on_other_inputs_is_refused():
    """--comm-dtype bf16 means the input dtype: on fp32 inputs (the CPU default) it would send fp32 while the user asked
    for bf16; refused naming both and the alternatives (was: accepted, fp32 on the wire, header 'FP8 on the wire')."""
    from cp_ops import config
    from cp_ops.cli._args import UsageError
    from cp_ops.cli.bench_args import check as _check_bench
    from cp_ops.cli.main import build_parser

    for dtype in ("fp32", "fp16"):
        args = build_parser().parse_args(["bench", "--comm-dtype", "bf16", "--dtype", dtype])
        with pytest.raises(UsageError, match=rf"--comm-dtype bf16 means 'the input dtype'.*inputs here are {dtype} "
                                             rf"\(--dtype\): use --comm-dtype none"):
            _check_bench(args, "cpu", 2, config.settings)


def _bench_kv_apart(rank, w, out):
    import torch

    from cp_ops import config
    from cp_ops.cli.bench import run_bench
    from cp_ops.cli.bench_args import check as _check_bench
    from cp_ops.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--device", "cpu", "--seqs", "16", "--modes", "auto,agkv,ulysses",
                                      "--heads", "4", "--head-dim", "8", "--comm-dtype", "e4m3:qvo", "--repeats", "1",
                                      "--warmup", "0", "--no-progress", "--dtype", "fp32", "--out", out])
    _check_bench(args, "cpu", w, config.settings)
    with contextlib.redirect_stdout(io.StringIO()):
        run_bench(rank, w, torch.device("cpu"), args)


def test_bench_auto_row_with_k_and_v_apart(tmp_path):
    """cp-ops bench --modes auto --comm-dtype e4m3:qvo (K and V apart) at W = 2: the auto row reports what the call ran,
    Ulysses with q, v, o in FP8 (was: describe() without comm_dtype said AGKV, and the row's comm_dtype raised 'AGKV
    gathers K and V together' on every rank); the agkv rows are skipped."""
    from dist_util import run_ranks

    out = str(tmp_path / "bench.json")
    run_ranks(_bench_kv_apart, 2, out)
    rows = json.load(open(out))["rows"]
    assert sorted((r["requested_mode"], r["mode"], r["comm_dtype"]) for r in rows) == [
        ("auto", "ulysses", "q=e4m3,v=e4m3,o=e4m3"), ("ulysses", "ulysses", "q=e4m3,v=e4m3,o=e4m3")], rows
