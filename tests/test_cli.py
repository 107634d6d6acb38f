"""CLI smoke: the CPU defaults of `cp-ops bench` (a real subprocess: the entry point) and `cp-ops run wan` (in this
process) exit 0 and print their tables, legends and spreads; argument errors are one line and exit 2 (one in a subprocess, the rest in this process
through tests/cli_util.py)."""

import json
import os
import subprocess
import sys

import pytest
from cli_util import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "cp_ops", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_bench_cpu_default(tmp_path):
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    p = _cli("bench", "--device", "cpu", "--out", str(out), "--plot", str(plot))
    assert p.returncode == 0, p.stderr[-3000:]
    from cp_ops.cli.bench import HEADER

    assert HEADER in p.stdout
    # the legend (issue 12 item 2): what speedup, the spread and rel err are; CPU is a functional check
    assert "speedup = 1-device time ÷ CP time: higher is better, ideal = W = 2" in p.stdout
    assert "[p25–p75] = interquartile range over the 5 samples" in p.stdout  # issue 9 item 6: steady state
    assert "CP ms = steady state: 1 call(s) back to back" in p.stdout and "lat ms = latency of one call" in p.stdout
    assert "bound = SDPA at one rank's share" in p.stdout and "%bound = bound ÷ CP ms" in p.stdout
    assert "on CPU the transfer term is left out" in p.stdout
    assert "rel err = max |CP − 1-device| / max |1-device|" in p.stdout
    assert "thread(s) per rank" in p.stdout and "functional check, not a performance claim" in p.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["S"], r["mode"]) for r in rows} == {(s, m) for s in (512, 1024, 2048) for m in ("agkv", "ulysses")}
    assert all(r["rel_err"] == 0.0 and r["cp_ms"] > 0 and r["single_ms"] > 0 for r in rows)
    meta = json.loads(out.read_text())["meta"]
    assert meta["p2p"]["GBps"] > 0 and meta["p2p"]["bytes"] == 2 * 1024 * 8 * 64 * 4  # AGKV K+V at S=2048, W=2, fp32
    for r in rows:  # the bound: attention at the share vs the bytes to receive over the probe's bandwidth
        local = 1 * (r["S"] // 2) * 8 * 64 * 4
        assert r["chunks"] == 1 and r["recv_bytes"] == (2 * (2 - 1) * local if r["mode"] == "agkv" else 4 * (2 - 1) * local // 2)
        assert abs(r["comm_ms"] - r["recv_bytes"] / meta["p2p"]["GBps"] / 1e6) < 1e-9
        assert r["bound_ms"] == r["attn_share_ms"] and r["cp_latency_ms"] > 0  # CPU: the attention share alone
        assert abs(r["bound_pct"] - 100 * r["bound_ms"] / r["cp_ms"]) < 1e-9
    for r in rows:  # the spread beside the median
        assert r["cp_ms_min"] <= r["cp_ms_q1"] <= r["cp_ms"] <= r["cp_ms_q3"] <= r["cp_ms_max"]
        assert r["single_ms_min"] <= r["single_ms_q1"] <= r["single_ms"] <= r["single_ms_q3"] <= r["single_ms_max"]
        assert r["speedup_q1"] <= r["speedup"] <= r["speedup_q3"]
    assert "case/s" not in p.stderr  # no progress bar when stderr is not a terminal (item 8)
    if "matplotlib" in sys.modules or __import__("importlib").util.find_spec("matplotlib"):
        assert plot.stat().st_size > 1000


def test_run_wan_cpu_default(tmp_path, monkeypatch, capsys):
    """In this process (the ``cp-ops`` entry point's real process is test_bench_cpu_default's)."""
    out = tmp_path / "wan.json"
    p = run_cli(["run", "wan", "--device", "cpu", "--out", str(out)], monkeypatch, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "CP ms  1-rank ms  speedup  max rel err" in p.stdout
    # item 3: say what ran (architecture, random weights) and why CPU speedups are low
    assert "Wan tiny architecture, random weights" in p.stdout
    assert "CPU: a functional check, not a performance claim" in p.stdout
    res = json.loads(out.read_text())
    assert res["meta"]["tokens"] == 128 and res["result"]["max_rel_err"] == 0.0
    assert res["meta"]["weights"] == "random" and res["meta"]["mode"] == "agkv" and res["meta"]["transport"] == "torch"


def test_env_and_help(monkeypatch, capsys):
    p = run_cli(["env"], monkeypatch, capsys)
    assert p.returncode == 0, p.stderr
    assert "transports:" in p.stdout and "torch  would run" in p.stdout and "fast   would not run:" in p.stdout
    assert "CP_OPS_TIMEOUT_S" in p.stdout and "(default)" in p.stdout
    p = run_cli(["bench", "--help"], monkeypatch, capsys)
    assert p.returncode == 0 and "--seqs" in p.stdout and "max over ranks" in p.stdout


BAD_INPUT = [
    (["bench", "--device", "cpu", "--seqs", "512,513"], "every S in --seqs must be a positive multiple of the CP world size 2; got [513]"),
    (["bench", "--device", "cpu", "--nproc", "0"], "--nproc must be >= 1; got 0"),
    (["bench", "--device", "cpu", "--modes", "ulysses", "--heads", "3"], "mode ulysses needs the CP world size 2 to divide --heads 3"),
    (["run", "wan", "--device", "cpu", "--transport", "fast"], "run wan: transport 'fast' cannot run: the tensors are on 'cpu'"),
    (["run", "wan", "--device", "cpu", "--layers", "0"], "--layers must be >= 1; got 0"),
    (["bench", "--device", "cpu", "--transports", "fast"], "transport 'fast' cannot run: the tensors are on 'cpu'"),
    (["run", "wan", "--device", "cpu", "--no-overlap"], "--no-overlap only applies with --compile"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT)
def test_cli_bad_input(args, message, monkeypatch, capsys):
    p = run_cli([*args, "--out", ""], monkeypatch, capsys)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cp-ops: ") and message in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_cli_bad_input_subprocess():
    """One bad input through a real ``python -m cp_ops`` (the others run in this process: tests/cli_util.py)."""
    args, message = BAD_INPUT[0]
    p = _cli(*args, "--out", "", timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cp-ops: ") and message in lines[0], p.stderr
    assert "Traceback" not in p.stderr  # caught before any rank starts: one line, no spawn traceback


def test_fast_pool_sizing_for_bench():
    import torch

    from cp_ops.cli.bench import fast_pool_gib

    # S=75600, B=1, H=40, D=128, bf16, W=2: K+V [1,S,40,128] + Ulysses 3 tensors/2 + inverse 1/2, x2 slots
    expected = 2 * 75600 * 40 * 128 * 2 * (2 + 1.5 + 0.5) / 2**30
    assert abs(fast_pool_gib([75600], 1, 40, 128, torch.bfloat16, 2) - expected) < 1e-9
    assert abs(expected - 5.767) < 1e-3
