"""Every zero-communication bound row measured so far, the newest per cell, in one ``bound.json`` and ``table.md``
(one entry per model x resolution x compile mode x W x implementation: cp_ops', and diffusers' own CP where
``--compare diffusers`` ran).

    python benchmarks/bound_all.py benchmarks/results/bound [RUN.json | RUN_FOLDER ...]

Starts from the rows ``OUT/bound.json`` holds (the claim folder's: every earlier run's rows, each with its
``source``), adds the rows of the ``cp-ops bound --out`` files given (a folder: its ``*.json`` files, recursively),
given order = age, so a later file's row of the same cell wins; rows at reduced depth are left out. The cells not
measured, with their reasons, come from ``OUT/not_measured.json`` (a list of ``{models, compile, [world_size],
reason}``). Writes ``OUT/bound.json`` and ``OUT/table.md``. (One run's files alone: ``benchmarks/bound_table.py``.)"""

import json
import pathlib
import sys

OUT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
KEYS = ("model", "config", "layers", "tokens", "compile", "cuda_graphs", "world_size", "one_gpu_ms", "rank0_ms",
        "bound_speedup", "cp_ops_cost_ms")
STALE = ("fake all-to-all unwritten in this run (before 2026-12-01c): Ulysses' kernels read stale memory and ran "
         "faster than on real data; re-measure")
INVALID = ("invalid: this side's outputs were not finite (diffusers' functional all-to-all left unwritten by the fake "
           "backend on that call: its kernels ran on stale memory); not comparable")
HOST_BOUND = ("no host column in this run; later runs of the same mode (2026-12-02) show both sides host-bound "
              "without CUDA graphs: the time is the host's")
NAMES = {("flux", "dev"): "FLUX.1-dev", ("qwenimage", "20b"): "Qwen-Image",
         ("zimage", "turbo"): "Z-Image-Turbo", ("ltx", "2b"): "LTX-Video 768x512x121",
         ("wan", "1.3b"): "Wan2.1-1.3B 480p", ("wan", "14b"): "Wan2.1-14B", ("hunyuanvideo", "13b"): "HunyuanVideo"}
#: the resolution by (model, image/video token count) (video: 81 / 61 / 129 frames)
RES = {("flux", 4096): " 1024²", ("flux", 3969): " 1008² (uneven shards)", ("zimage", 4096): " 1024²",
       ("qwenimage", 6889): " 1328²", ("wan", 32760): " 480p", ("wan", 75600): " 720p", ("hunyuanvideo", 32640): " 544x960x61",
       ("hunyuanvideo", 118800): " 720p x129"}


def mode_of(r):
    base = r["compile"] or "eager"
    return base + ("+capture" if r["cuda_graphs"] == "forward" else "+graphs" if r["cuda_graphs"] else "")


def runs(paths):
    """``(source, data)`` of every ``cp-ops bound --out`` file under ``paths``, in the order given."""
    for p in map(pathlib.Path, paths):
        for f in sorted(p.rglob("*.json")) if p.is_dir() else [p]:
            try:
                d = json.loads(f.read_text())
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(d, dict) and isinstance(d.get("rows"), list) and f.name not in ("bound.json",
                                                                                         "not_measured.json"):
                yield f"{f.parent.name}/{f.name}", d


def cell(r):
    return r["model"], r["config"], r["tokens"], mode_of(r), r["world_size"], r.get("impl", "cp_ops")


cells, failed, left_out = {}, {}, set()
BASE = json.loads((OUT / "bound.json").read_text()) if (OUT / "bound.json").exists() else dict(rows=[], failed=[])
for row in BASE["rows"]:
    cells[cell(row)] = row
for f in BASE["failed"]:
    failed[(f["model"], f["config"], f["compile"])] = f
for path, d in runs(sys.argv[2:]):
    for r in d["rows"]:
        if r.get("model") is None:  # not a bound row (another kind of run in the same folder)
            continue
        if (r.get("model"), r.get("config")) not in NAMES:  # reduced depth ('dev (2+2 of 19+38 layers)'), or a config
            left_out.add(f"{path} ({r.get('model')} {r.get('config')})")  # NAMES does not name: not a cell, said
            continue
        if "skipped" in r:
            failed[(r.get("model"), r.get("config"), mode_of(r))] = dict(
                model=r.get("model"), config=r.get("config"), compile=mode_of(r), source=path, reason=r["skipped"])
            continue
        if "rank0_ms" not in r or r.get("steps"):
            continue
        row = {k: r.get(k) for k in KEYS}
        row["impl"] = r.get("impl", "cp_ops")
        row.update({k: r[k] for k in ("mode", "one_gpu_from", "rank0_raw_ms", "fill_ms", "plain_ms", "cp_ops_cost_pct",
                                      "host_ms", "host_bound", "plain_host_ms", "plain_host_bound") if k in r})
        row["source"] = path
        if r.get("plain_ms") is not None:  # the cost with the fake collectives' writes taken out of cp_ops' side only
            raw = r.get("rank0_raw_ms") or r["rank0_ms"]
            row["cp_ops_cost_writes_out_ms"] = r["rank0_ms"] - r["plain_ms"]
            row["cp_ops_cost_writes_out_pct"] = 100.0 * row["cp_ops_cost_writes_out_ms"] / raw
        if row["impl"] != "cp_ops" and r.get("outputs_finite") is False:
            row["note"] = INVALID
        cells[cell(row)] = row  # newest wins
for (m, c, mode) in list(failed):
    if any(k[0] == m and k[1] == c and k[3] == mode and k[5] == "cp_ops" for k in cells):
        del failed[(m, c, mode)]  # measured since

order = list(NAMES)
modes = ["eager", "eager+graphs", "regional", "regional+graphs", "regional+capture", "full", "full+graphs",
         "full+capture"]
rows = sorted(cells.values(), key=lambda r: (order.index((r["model"], r["config"])), r["tokens"],
                                             modes.index(mode_of(r)), r["world_size"], r["impl"] != "cp_ops",
                                             r["impl"]))
NOT_MEASURED = json.loads((OUT / "not_measured.json").read_text()) if (OUT / "not_measured.json").exists() else []
out = dict(what=__doc__.split("\n\n")[0], keys=list(KEYS), rows=rows, failed=list(failed.values()),
           not_measured=NOT_MEASURED)
(OUT / "bound.json").write_text(json.dumps(out, indent=1) + "\n")

lines = ["| model | tokens | compile | W | impl | mode | 1 GPU ms (from) | rank 0 ms | bound | cp_ops cost ms (%) | "
         "writes out | host-bound | source | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    cost = "" if r["cp_ops_cost_ms"] is None else f"{r['cp_ops_cost_ms']:.2f} ({r['cp_ops_cost_pct']:.1f} %)"
    wo = "" if r["cp_ops_cost_ms"] is None else f"{r['cp_ops_cost_writes_out_pct']:.1f} %"
    hb = "" if "host_bound" not in r else ("both" if r["host_bound"] and r.get("plain_host_bound") else
                                           "cp_ops" if r["host_bound"] else "plain" if r.get("plain_host_bound") else "no")
    note = {STALE: "stale all-to-all", HOST_BOUND: "host (no column)", INVALID: "invalid (outputs not finite)"}.get(
        r.get("note"), "")
    lines.append(f"| {NAMES[(r['model'], r['config'])]}{RES.get((r['model'], r['tokens']), '') if r['config'] != '1.3b' else ''} | {r['tokens']} | {mode_of(r)} | {r['world_size']} | "
                 f"{r['impl']} | {r.get('mode', '')} | {r['one_gpu_ms']:.1f} ({r.get('one_gpu_from', 'diffusers')}) | "
                 f"{r['rank0_ms']:.1f} | {r['bound_speedup']:.2f}x | {cost} | {wo} | {hb} | {r['source'].split('_torch')[0]} | "
                 f"{note} |")
for f in failed.values():
    lines.append(f"| {NAMES[(f['model'], f['config'])]} | | {f['compile']} | | | | failed: {f['reason'][:120]} | | | | | | "
                 f"{f['source'].split('_torch')[0]} | |")
LEGEND = ("\ncp_ops cost = rank 0's measured forward (the fake collectives' writes inside) minus the plain side's (its "
          "own stand-in copies inside), % of the measured forward; writes out = the same with the writes taken out of "
          "cp_ops' side only (rank 0 minus plain): the two bracket cp_ops' own cost (under compile the plain side's "
          "copies fuse into the kernels that make Q, K and V, the writes cannot). host-bound: which side's host time "
          ">= 0.9 x its measured time. source: the results folder. stale all-to-all: measured before 2026-12-01c.\n")
(OUT / "table.md").write_text("\n".join(lines) + "\n" + LEGEND)
print(f"{len(rows)} rows, {len(failed)} failed modes -> bound.json, table.md")
if left_out:  # rows of a (model, config) NAMES does not list: reduced depth, or a model to add to NAMES
    print(f"left out {len(left_out)} files' rows of configs not in NAMES: " + "; ".join(sorted(left_out)))
