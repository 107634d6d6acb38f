"""benchmarks/bound_all.py: the bound claim's rows (benchmarks/results/bound/bound.json) merged with a new run's, the
newest per cell (model x tokens x compile mode x W x impl), the claim's keys in every row, the not-measured list read
from the output folder."""

import json
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLAIM = ROOT / "benchmarks" / "results" / "bound"
KEYS = ("model", "config", "layers", "tokens", "compile", "cuda_graphs", "world_size", "one_gpu_ms", "rank0_ms",
        "bound_speedup", "cp_ops_cost_ms")


def cell(r):
    graphs = r["cuda_graphs"]
    mode = (r["compile"] or "eager") + ("+capture" if graphs == "forward" else "+graphs" if graphs else "")
    return r["model"], r["config"], r["tokens"], mode, r["world_size"], r.get("impl", "cp_ops")


def _merge(out, *runs):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bound_all.py"), str(out), *map(str, runs)], check=True,
                   capture_output=True, timeout=120)
    return json.loads((out / "bound.json").read_text())


def test_the_claim_merges_to_itself(tmp_path):
    """The committed claim, merged with no new run, gives its own rows back: unique cells, every key, the bound the
    times give; the table has one line per row."""
    shutil.copy(CLAIM / "bound.json", tmp_path / "bound.json")
    (tmp_path / "not_measured.json").write_text(json.dumps([dict(models="m", compile="full", reason="r")]))
    before = json.loads((CLAIM / "bound.json").read_text())
    out = _merge(tmp_path)
    assert out["not_measured"] == [dict(models="m", compile="full", reason="r")]
    rows = out["rows"]
    assert len(rows) > 50 and [cell(r) for r in rows] == [cell(r) for r in before["rows"]]
    assert len({cell(r) for r in rows}) == len(rows)
    for r in rows:
        assert all(k in r for k in KEYS), r["source"]
        assert abs(r["bound_speedup"] - r["one_gpu_ms"] / r["rank0_ms"]) < 1e-6 * r["bound_speedup"], r["source"]
    table = (tmp_path / "table.md").read_text().splitlines()
    assert len([l for l in table if l.startswith("| ") and "---" not in l]) == len(rows) + len(out["failed"]) + 1


def test_a_new_run_wins_its_cells(tmp_path):
    """A new run's row of a measured cell replaces it (its source named); a row of a new cell is added; a row at
    reduced depth is left out."""
    shutil.copy(CLAIM / "bound.json", tmp_path / "bound.json")
    before = json.loads((CLAIM / "bound.json").read_text())["rows"]
    old = next(r for r in before if r.get("impl", "cp_ops") == "cp_ops")
    newer = dict({k: old[k] for k in KEYS}, cp_ops_cost_ms=None, rank0_ms=old["rank0_ms"] * 0.9,
                 bound_speedup=old["one_gpu_ms"] / (old["rank0_ms"] * 0.9))
    added = dict(newer, world_size=16, rank0_ms=old["rank0_ms"] / 5, bound_speedup=old["one_gpu_ms"] / (old["rank0_ms"] / 5))
    reduced = dict(newer, config="dev (2+2 of 19+38 layers)")
    run = tmp_path / "new" / "json"
    run.mkdir(parents=True)
    (run / "step.json").write_text(json.dumps(dict(meta={}, rows=[newer, added, reduced])))
    rows = _merge(tmp_path, run)["rows"]
    assert len(rows) == len(before) + 1
    got = {cell(r): r for r in rows}
    assert got[cell(old)]["rank0_ms"] == newer["rank0_ms"] and got[cell(old)]["source"] == "json/step.json"
    assert got[cell(added)]["world_size"] == 16
