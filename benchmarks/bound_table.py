"""Collect ``cp-ops bound MODEL --worlds ... --out X.json`` results into one ``bound.json`` and a Markdown table.

    python benchmarks/bound_table.py DIR/runs/bound_*.json --out DIR/bound.json --profiles DIR/bound_profiles.json

``bound.json``: ``{"meta": {model: that run's meta}, "rows": [...]}``, one row per model x compile mode x W with the
keys issue 21 names (``model, config, layers, tokens, compile, cuda_graphs, world_size, one_gpu_ms, rank0_ms,
bound_speedup, cp_ops_cost_ms``) and the run's others (``one_gpu_from``, ``diffusers_ms``, ``group1_ms``,
``plain_ms``, ``cp_ops_cost_pct``, ``mode``, ``rank0_samples``, ...). Rows since 2026-12-01c: ``rank0_ms`` is the
measured forward (``rank0_raw_ms``, the samples) minus ``fill_ms`` (the fake collectives' writes, timed alone). ``--profiles``: the runs' profiles
(``--profile``), per model and compile mode, corrected for the CUPTI marker "Command Buffer Full" (a host wait, not
device work; runs before commit cd0732b counted it in ``busy_ms`` and the ``other`` category).
"""

from __future__ import annotations

import argparse
import json
import statistics

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


def _spread(samples) -> str:
    if not samples or len(samples) < 2:
        return ""
    return f"{min(samples):.0f}–{max(samples):.0f}"


def table(rows: list[dict]) -> str:
    host = any("host_ms" in r for r in rows)  # since 2026-12-02: the host's time to enqueue a forward
    out = ["| model (tokens) | compile | W | mode | 1 GPU ms (from) | rank 0 ms (measured min–max − fill) | bound | "
           "cp_ops cost ms (%) |" + (" host ms rank 0 / plain (* host-bound) |" if host else ""),
           "|---|---|---|---|---|---|---|---|" + ("---|" if host else "")]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['model']} {r['config']} | {r['compile']} | | | failed: {r['skipped']} | | | |"
                       + (" |" if host else ""))
            continue
        comp = (r["compile"] or "eager") + (" + capture" if r["cuda_graphs"] == "forward" else
                                            " + graphs" if r["cuda_graphs"] else "")
        src = "diffusers" if r["one_gpu_from"] == "diffusers" else "group of 1"
        cost = f"{r['cp_ops_cost_ms']:.2f} ({r['cp_ops_cost_pct']:.1f}%)" if "cp_ops_cost_ms" in r else ""
        mode = r["mode"] if r.get("impl", "cp_ops") == "cp_ops" else f"{r['impl']} ({r['mode']})"  # --compare
        bound = "-" if r.get("bound_speedup") is None else f"{r['bound_speedup']:.2f}x"
        if r.get("invalid"):
            bound += f" invalid: {r['invalid']}"
        out.append(f"| {r['model']} {r['config']} ({r['tokens']}) | {comp} | {r['world_size']} | {mode} | "
                   f"{r['one_gpu_ms']:.1f} ({src}) | {r['rank0_ms']:.1f} ({_spread(r.get('rank0_samples'))}"
                   f"{' − %.1f' % r['fill_ms'] if 'fill_ms' in r else ''}) | "
                   f"{bound} | {cost} |" + (f" {_host(r)} |" if host else ""))
    return "\n".join(out)


def _host(r: dict) -> str:
    """``rank 0's host ms[*] / the plain side's[*]`` (``*``: host-bound); '' where the row has none."""
    parts = [f"{r[p + 'host_ms']:.1f}{'*' if r.get(p + 'host_bound') else ''}"
             for p in ("", "plain_") if r.get(p + "host_ms") is not None]
    return " / ".join(parts)


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
    print(table(d["rows"]))
    med = [r["cp_ops_cost_pct"] for r in d["rows"] if "cp_ops_cost_pct" in r]
    if med:
        print(f"\ncp_ops cost: median {statistics.median(med):.1f}% of rank 0's forward over {len(med)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
