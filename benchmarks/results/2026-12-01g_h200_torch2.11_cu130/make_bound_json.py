"""Builds bound.json (issue 21's keys, one entry per model x compile mode x W x implementation) from runs/*.json of
the 2026-12-01g call, with what each row is and the rows not measured (and why). Run from this folder."""

import json
import pathlib

HERE = pathlib.Path(__file__).parent
KEYS = ("model", "config", "layers", "tokens", "compile", "cuda_graphs", "world_size", "one_gpu_ms", "rank0_ms",
        "bound_speedup", "cp_ops_cost_ms")
INVALID_DIFFUSERS_ULYSSES = (
    "invalid: diffusers' functional all-to-all was left unwritten on this call (the probe that decides whether to write "
    "it read a stale block holding an earlier probe's values as 'written'; fixed after the call: random probe values), "
    "so its attention and GEMMs ran on stale memory and its outputs were non-finite: the time is not comparable")
REGIONAL_ANOMALY = (
    "suspect: under `regional` (no CUDA graphs) every cp_ops row at W >= 4 is 20-42 ms slower than its plain stand-in "
    "(W = 2: 0.4-1.8 ms), on three models, AGKV and Ulysses alike; not explained in this call (README)")

rows, not_measured = [], []
for f in sorted((HERE / "runs").glob("bound_*.json")):
    run = json.loads(f.read_text())
    step = f.stem[len("bound_"):]
    for r in run["rows"]:
        if "skipped" in r:
            not_measured.append(dict(step=step, model=run["meta"]["model"], compile=r.get("compile"),
                                     cuda_graphs=r.get("cuda_graphs"), world_size=r.get("world_size"),
                                     impl=r.get("impl"), reason=r["skipped"]))
            continue
        row = {k: r.get(k) for k in KEYS}
        row.update({k: v for k, v in r.items() if k not in KEYS and k != "cls"})
        row["step"] = step
        if r.get("impl") == "diffusers ulysses" and not r.get("outputs_finite", True):
            row["invalid"] = INVALID_DIFFUSERS_ULYSSES
        if r.get("impl") == "cp_ops" and r["compile"] == "regional" and not r["cuda_graphs"] and r["world_size"] >= 4:
            row["suspect"] = REGIONAL_ANOMALY
        rows.append(row)
not_measured += [
    dict(step="ltx_full", model="ltx", compile="full", cuda_graphs=True, world_size=[2, 4, 8],
         reason="killed at its time limit (122 s): the whole-forward compile + CUDA graphs of the diffusers side alone "
                "took 56.5 s (first call), cp_ops W2 did not finish in the rest; ~4 min for the 4 sides"),
    dict(step=None, model="zimage", compile="full", cuda_graphs=None, world_size=None,
         reason="not run: ZImageTransformer2DModel.forward enters `with torch.device(...)`, which Dynamo refuses "
                "(fullgraph=True fails in diffusers' own model, unparallelized and parallelized; CPU, torch 2.13, "
                "tiny config)"),
    dict(step=None, model="flux, qwenimage, wan", compile="full", cuda_graphs=None, world_size=None,
         reason="not run (device time): the whole forward traces with fullgraph=True on CPU (torch 2.13, tiny configs, "
                "aot_eager), diffusers' and cp_ops' alike; a GPU compile is ~1 min a side (LTX-Video: 56.5 s)"),
    dict(step="wan_steps", model="wan", compile=False, cuda_graphs=False, world_size=8, impl="diffusers ulysses",
         reason="diffusers refused (ulysses_anything, 12 heads over 8): AssertionError: Padding head num 4 should be "
                "less than new local head num 2 (log_call1.txt); the whole wan_steps mode then failed on a bug in the "
                "failure handler (UnboundLocalError, fixed after the call): no Wan --steps row"),
    dict(step=None, model="wan 14b, hunyuanvideo", compile="regional+graphs", cuda_graphs=True, world_size=None,
         reason="not run (device time): seconds-long forwards, eager rows near-linear already (2026-12-01c/e)"),
]
meta = json.loads((HERE / "runs" / "bound_flux_rc.json").read_text())["meta"]
meta = {k: meta[k] for k in ("gpu", "torch", "cuda", "dtype", "transport", "chunks", "group", "fill_timing",
                             "fake_outputs", "diffusers") if k in meta}
meta.update(code="cd49827 (branch h4-rows)", call="one call, 577 s (log_call1.txt, call.sh)",
            weights="random (released configs, full depth)", batch=1)
(HERE / "bound.json").write_text(json.dumps(dict(meta=meta, rows=rows, not_measured=not_measured), indent=1) + "\n")
print(len(rows), "rows,", len(not_measured), "not measured")


# ---- the README's consolidated table: every bound row measured so far (2026-12-01, c, e, g), the latest per key ----
def _table() -> str:
    res = HERE.parent
    best = {}

    def put(r, source, note=""):
        if "skipped" in r:
            return
        key = (r["model"], r["tokens"], r["compile"] or "eager", bool(r["cuda_graphs"]), r["world_size"],
               r.get("impl", "cp_ops"), r.get("steps", 0))
        best[key] = (r, source, note)

    c = json.loads((res / "2026-12-01c_h200_torch2.11_cu130" / "bound.json").read_text())
    for r in c["rows"]:
        src = "01" if r.get("measured", "").startswith("2026-12-01 ") else "01c"
        unwritten = "unwritten" in r.get("fake_outputs", "") and r["mode"] == "ulysses"
        put(r, src, "a2a unwritten: optimistic" if unwritten else "")
    e = json.loads((res / "2026-12-01e_h200_torch2.11_cu130" / "bound.json").read_text())
    for r in e["rows"]:
        if r["model"] == "flux" and r["world_size"] == 8 and r.get("call") == 2:
            continue  # call 2's machine was host-slow (its README): call 1's row is the one to quote
        if "bound_fill_device" in r:
            r = dict(r, rank0_ms=r["rank0_ms_fill_device"], bound_speedup=r["bound_fill_device"])
        put(r, "01e")
    g = json.loads((HERE / "bound.json").read_text())
    for r in g["rows"]:
        note = "INVALID (a2a unwritten, non-finite)" if "invalid" in r else ("suspect (README)" if "suspect" in r else "")
        put(r, "01g", note)
    names = {"flux": "FLUX.1-dev 1024²", "qwenimage": "Qwen-Image 1328²", "zimage": "Z-Image-Turbo 1024²",
             "ltx": "LTX-Video 768x512 121f", "wan": "Wan2.1", "hunyuanvideo": "HunyuanVideo"}
    order = {"eager": 0, "regional": 1, "full": 2}
    lines = ["| model (tokens) | compile | steps | W | impl: mode | 1 GPU ms (from) | rank 0 ms | bound | cp_ops cost ms (%) "
             "| from | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(best, key=lambda k: (k[0], k[1], k[6], order[k[2]], k[3], k[4], k[5] != "cp_ops", k[5])):
        r, src, note = best[key]
        model, tokens, comp, graphs, w, impl, steps = key
        name = names.get(model, model) + (f" {r['config']}" if model in ("wan", "hunyuanvideo") else "")
        one = f"{r['one_gpu_ms']:.1f} ({'diffusers' if r['one_gpu_from'] == 'diffusers' else 'group of 1'})"
        cost = (f"{r['cp_ops_cost_ms']:.2f} ({r['cp_ops_cost_pct']:.1f} %)" if r.get("cp_ops_cost_ms") is not None
                else "")
        per = f" = {r['step_ms']:.1f}/step" if steps else ""
        lines.append(f"| {name} ({tokens}) | {comp}{'+graphs' if graphs else ''} | {steps or ''} | {w} | "
                     f"{impl.replace('diffusers ', 'diffusers ')}: {r['mode']} | {one} | {r['rank0_ms']:.1f}{per} | "
                     f"{r['bound_speedup']:.2f}x | {cost} | {src} | {note} |")
    return "\n".join(lines) + "\n"


(HERE / "table.md").write_text(_table())
print("table.md written")
