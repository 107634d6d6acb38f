"""benchmarks/bound_all.py: every committed bound row, the newest per cell (model x tokens x compile mode x W x impl),
issue 21's keys in every row, the not-measured list read from the output folder."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEYS = ("model", "config", "layers", "tokens", "compile", "cuda_graphs", "world_size", "one_gpu_ms", "rank0_ms",
        "bound_speedup", "cp_ops_cost_ms")


def test_newest_row_per_cell_with_the_issue_keys(tmp_path):
    (tmp_path / "not_measured.json").write_text(json.dumps([dict(models="m", compile="full", reason="r")]))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bound_all.py"), str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    out = json.loads((tmp_path / "bound.json").read_text())
    assert out["not_measured"] == [dict(models="m", compile="full", reason="r")]
    rows = out["rows"]
    assert len(rows) > 50

    def cell(r):
        graphs = r["cuda_graphs"]
        mode = (r["compile"] or "eager") + ("+capture" if graphs == "forward" else "+graphs" if graphs else "")
        return r["model"], r["config"], r["tokens"], mode, r["world_size"], r["impl"]

    cells = [cell(r) for r in rows]
    assert len(cells) == len(set(cells))
    for r in rows:
        assert all(k in r for k in KEYS), r["source"]
        assert abs(r["bound_speedup"] - r["one_gpu_ms"] / r["rank0_ms"]) < 1e-6 * r["bound_speedup"], r["source"]
    # newest wins: no folder after a row's own holds a run of the same cell
    for r in rows:
        folder = r["source"].split("/")[0]
        for later in sorted(p for p in (ROOT / "benchmarks" / "results").iterdir() if p.is_dir() and "_h200_" in
                            p.name and p.name > folder):
            for f in list(later.glob("runs/*.json")) + list(later.glob("call*/*.json")) + list(later.glob("bound_*.json")):
                d = json.loads(f.read_text())
                for x in d.get("rows", []) if isinstance(d, dict) and isinstance(d.get("rows"), list) else []:
                    if "rank0_ms" in x and not x.get("steps") and "skipped" not in x:
                        assert cell(dict(x, impl=x.get("impl", "cp_ops"))) != cell(r), (r["source"], str(f))
    table = (tmp_path / "table.md").read_text().splitlines()
    assert len([l for l in table if l.startswith("| ") and "---" not in l]) == len(rows) + len(out["failed"]) + 1
