"""Collect ``cp-ops bound MODEL --worlds ... --out X.json`` results into one ``bound.json`` and a Markdown table.

    python benchmarks/bound_table.py DIR/runs/bound_*.json --out DIR/bound.json --profiles DIR/bound_profiles.json

``bound.json``: ``{"meta": {model: that run's meta}, "rows": [...]}``, one row per model x compile mode x W with the
keys ``model, config, layers, tokens, compile, cuda_graphs, world_size, one_gpu_ms, rank0_ms, bound_speedup,
cp_ops_cost_ms`` and the run's others (``one_gpu_from``, ``diffusers_ms``, ``group1_ms``, ``plain_ms``,
``cp_ops_cost_pct``, ``mode``, ``rank0_samples``, ...); ``rank0_ms`` is the measured forward (``rank0_raw_ms``, the
samples) minus ``fill_ms`` (the fake collectives' writes, timed alone). The table: ``cp_ops.cli.bound_report``'s.
``--profiles``: the runs' profiles (``--profile``), per model and compile mode, without the CUPTI marker "Command
Buffer Full" (a host wait, not device work).
"""

from __future__ import annotations

import argparse
import json
import statistics

from cp_ops.cli.bound_report import results_table

MARKER = "Command Buffer Full"


def _fix_profile(p: dict) -> dict:
    p = dict(p, by_category=dict(p["by_category"]))
    for name, ms, _ in p["top"]:
        if name == MARKER:
            p["busy_ms"] -= ms
            p["by_category"]["other"] = p["by_category"].get("other", 0.0) - ms
    p["top"] = [t for t in p["top"] if t[0] != MARKER]
    return p


def collect(paths: list[str]) -> dict:
    metas, rows, profiles = {}, [], {}
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        key = f"{d['meta']['model']} {d['meta']['config']}"
        metas[key] = d["meta"]
        rows += d["rows"]
        for mode, sides in (d.get("profiles") or {}).items():
            profiles.setdefault(key, {})[mode] = {s: _fix_profile(p) for s, p in sides.items()}
    return dict(meta=metas, rows=rows, profiles=profiles)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="the runs' --out JSON files")
    ap.add_argument("--out", default=None, help="write the collected bound.json here (meta and rows)")
    ap.add_argument("--profiles", default=None, help="write the runs' corrected profiles here")
    a = ap.parse_args(argv)
    d = collect(a.paths)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(meta=d["meta"], rows=d["rows"]), f, indent=1)
    if a.profiles:
        with open(a.profiles, "w") as f:
            json.dump(d["profiles"], f, indent=1)
    print(results_table(d["rows"]))
    med = [r["cp_ops_cost_pct"] for r in d["rows"] if "cp_ops_cost_pct" in r]
    if med:
        print(f"\ncp_ops cost: median {statistics.median(med):.1f}% of rank 0's forward over {len(med)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
