"""Markdown tables of benchmarks/fp8.py's JSON: ``python benchmarks/fp8_table.py DIR`` (the OUT of gpu_fp8.sh)."""

from __future__ import annotations

import glob
import json
import os
import sys


def _load(d: str, sec: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(d, "**", f"fp8_{sec}.json"), recursive=True)):
        with open(path) as f:
            rows += json.load(f)["rows"]
    return [r for r in rows if "error" not in r]


def _p(x: float) -> str:
    return f"{100 * x:.2f}%"


def _err(m: dict | None) -> str:
    """``max / rms`` of an error row (``rel_max``, ``rel_rms``), or '—'."""
    return "—" if m is None else f"{_p(m['rel_max'])} / {_p(m['rel_rms'])}"


def main(d: str) -> None:
    models = _load(d, "models")
    if models:
        print("| model | tokens | variant | fwd vs bf16 comm (max / rms) | fwd vs 1 GPU (max / rms) "
              "| latents after N steps vs bf16 comm (max / rms) | vs 1 GPU (max / rms) |")
        print("|---|---|---|---|---|---|---|")
        for r in models:
            a, b = r.get("fwd_vs_bf16"), r["fwd_vs_1gpu"]
            c, e = r.get("lat_vs_bf16"), r["lat_vs_1gpu"]
            print(f"| {r['model']} {r['config']} | {r['tokens']} | {r['variant']} | {_err(a)} | {_err(b)} | "
                  f"{r['steps']}: {_err(c)} | {_err(e)} |")
        print()
    micro = _load(d, "micro")
    if micro:
        print("| tokens x heads | tensors | e4m3 max / rms | e5m2 max / rms |")
        print("|---|---|---|---|")
        by = {}
        for r in micro:
            by.setdefault((r["tokens"], r["heads"], r["tensors"]), {})[r["fmt"]] = r
        for (s, h, t), fm in by.items():
            cells = [_err(fm.get(f)) for f in ("e4m3", "e5m2")]
            print(f"| {s} x {h} | {t} | {cells[0]} | {cells[1]} |")
        print()
    vae = _load(d, "vae")
    if vae:
        print("| model | steps | image | variant | pixel PSNR vs bf16 comm (dB) "
              "| decoder output vs bf16 comm (max / rms) |")
        print("|---|---|---|---|---|---|")
        for r in vae:
            print(f"| {r['model']} {r['config']} ({r['tokens']} tokens, {r['heads']} heads) | {r['steps']} | "
                  f"{'x'.join(map(str, r['image']))} | {r['variant']} | {r['psnr_db']:.1f} | "
                  f"{_err(r)} |")
        print()
    ker = _load(d, "kernels")
    if ker:
        print("| tokens | W | S_local | bf16 MB / fp8 MB | encode µs | decode µs | (torch enc / dec µs) "
              "| Ulysses: codec µs vs link µs saved | AGKV: codec µs vs link µs saved |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in ker:
            tor = f"{r.get('encode_torch_us', 0):.0f} / {r.get('decode_torch_us', 0):.0f}"
            print(f"| {r['tokens']} | {r['world']} | {r['s_local']} | {r['bytes_bf16'] / 1e6:.1f} / "
                  f"{r['bytes_fp8'] / 1e6:.1f} | {r['encode_us']:.1f} | {r['decode_us']:.1f} | {tor} | "
                  f"{r['ulysses_codec_us']:.1f} vs {r['ulysses_saved_link_us']:.1f} | "
                  f"{r['agkv_codec_us']:.1f} vs {r['agkv_saved_link_us']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1])
