"""`cp-ops bench --mesh OxI` and `cp-ops run MODEL --mesh OxI` (in this process, tests/cli_util.py; 4 CPU gloo ranks):
the mesh in the header and the JSON, the 2-D output equal to one device, each dim's communication time (0 for a dim
of size 1); bad --mesh values are one line naming the rule and the values."""

import json

import pytest
from cli_util import run_cli

SMALL = ["--device", "cpu", "--nproc", "4", "--repeats", "1", "--warmup", "0"]


@pytest.mark.parametrize("shape,mode,dims", [("2x2", "agkv_ulysses", ("ulysses", "agkv")),
                                             ("4x1", "agkv", ("agkv",))])
def test_bench_mesh(shape, mode, dims, tmp_path, monkeypatch, capsys):
    out = tmp_path / "b.json"
    p = run_cli(["bench", *SMALL, "--mesh", shape, "--seqs", "32", "--heads", "4", "--head-dim", "8", "--out",
                 str(out), "--no-progress"], monkeypatch, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    o, i = shape.split("x")
    assert f"CP4 on a mesh {shape} (agkv {o} x ulysses {i}; rows " in p.stdout, p.stdout
    assert "ulysses ms   agkv ms" in p.stdout and "each dim's collectives of one call timed alone" in p.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["mesh"]["shape"] == [int(o), int(i)]
    (row,) = data["rows"]
    assert row["mode"] == mode and row["rel_err"] <= 1e-6, row  # a 4x1 mesh runs 1-D AGKV over its column
    for d in ("ulysses", "agkv"):
        t = row[f"{d}_comm_ms"]
        assert row["comm_ms_by_dim"][d] == t and (t > 0 if d in dims else t == 0.0), (d, row)
    local = 8 * 4 * 8 * 4  # B * S/W * H * D * fp32
    assert row["recv_bytes"] == {"2x2": 4 * local // 2 + 2 * local, "4x1": 2 * 3 * local}[shape]


def test_run_mesh(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    p = run_cli(["run", "wan", *SMALL, "--mesh", "1x4", "--out", str(out)], monkeypatch, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "CP4 on a mesh 1x4 (agkv 1 x ulysses 4; rows [[0, 1, 2, 3]]) mode=agkv_ulysses" in p.stdout, p.stdout
    assert "per-dim communication per forward (2 attention calls" in p.stdout, p.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["mesh"]["shape"] == [1, 4]
    r = data["result"]
    assert r["max_rel_err"] <= 1e-5 and r["attention_calls"] == 2, r
    assert r["comm_ms_by_dim"] == {"ulysses": r["ulysses_comm_ms"], "agkv": 0.0} and r["ulysses_comm_ms"] > 0, r


BAD_MESH = [
    (["bench", "--nproc", "4", "--mesh", "3x2"], "bench: --mesh 3x2: outer x inner must equal the CP world size 4; "
                                                 "got 3 x 2 = 6 (for this mesh, pass --nproc 6)"),
    (["bench", "--mesh", "2x2"], "the CP world size 2; got 2 x 2 = 4 (for this mesh, pass --nproc 4)"),  # --nproc forgotten
    (["bench", "--nproc", "4", "--mesh", "2x2", "--heads", "3"],
     "the inner (Ulysses) degree must divide the heads; got heads=3, inner=2"),
    (["bench", "--mesh", "2by2"], "--mesh takes OxI, two ints >= 1 (outer AGKV degree x inner Ulysses degree, e.g. "
                                  "2x2); got '2by2'"),
    (["bench", "--mesh", "0x2"], "both degrees must be >= 1; got outer=0, inner=2"),
    (["bench", "--nproc", "4", "--mesh", "2x2", "--modes", "agkv"],
     "--modes takes auto,agkv_ulysses with --mesh; got ['agkv'] (--mesh runs the 2-D mode"),
    (["bench", "--modes", "agkv_ulysses"], "got ['agkv_ulysses'] (the 2-D mode runs with --mesh OxI)"),
    (["bench", "--nproc", "4", "--mesh", "2x2", "--comm-dtype", "e4m3"], "--mesh rows run without FP8 for now"),
    (["run", "wan", "--nproc", "4", "--mesh", "2x2", "--mode", "ulysses"], "--mesh runs the 2-D mode (mode 'auto' on "
                                                                           "the mesh); got --mode ulysses"),
    (["run", "wan", "--nproc", "4", "--mesh", "4x1", "--cfg"],
     "run wan: --mesh 4x1: outer x inner must equal the CP world size 2 (of each CFG lane: W / 2 with --cfg); got 4 x "
     "1 = 4 (for this mesh, pass --nproc 8)"),
]


@pytest.mark.parametrize("args,message", BAD_MESH)
def test_bad_mesh(args, message, monkeypatch, capsys):
    p = run_cli([*args, "--device", "cpu", "--out", ""], monkeypatch, capsys)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cp-ops: ") and message in lines[0], p.stderr


def test_bad_mesh_under_torchrun_says_how_many_ranks_to_launch(monkeypatch):
    """Under torchrun --nproc does not apply: the hint names the ranks to launch instead (3 x 2 on 4 ranks: 6)."""
    import argparse

    from cp_ops.cli._args import UsageError, check_mesh

    for key, val in (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(key, val)
    with pytest.raises(UsageError, match=r"got 3 x 2 = 6 \(for this mesh, launch 6 ranks in all \(torchrun: --nnodes x --nproc-per-node = 6\)\)$"):
        check_mesh(argparse.Namespace(mesh="3x2"), "bench", 4, 8)
    with pytest.raises(UsageError, match=r"launch 12 ranks"):  # --cfg: two lanes of 3 x 2
        check_mesh(argparse.Namespace(mesh="3x2"), "run wan", 4, 8, lanes=2)
