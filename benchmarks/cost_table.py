"""The cost model's table (cp_ops.cost): predicted attention-step speedup of every layout on 1×8, 2×8, 4×8 and 8×8
H200 GPUs for Wan2.1-14B 720p, HunyuanVideo 720p/129 frames and FLUX.1 1024², beside the zero-communication bound
measured on one GPU where it was (shared/anchors.md, 2026-12-01; whole forward, so not the same quantity: it bounds a
model's forward, this predicts its attention step; both ≤ W).

    python -m benchmarks.cost_table [--network-gbps 50] [--out benchmarks/results/cost_model/cost_table.md]
"""

from __future__ import annotations

import argparse
import os

from cp_ops import cost

#: name -> (tokens, heads, head dim, {W: measured zero-communication bound of the forward, from shared/anchors.md})
MODELS = {
    "Wan2.1-14B 720p, 81 frames (75600 tokens, 40 heads)": (75600, 40, 128, {8: "8.12x (eager)"}),
    "HunyuanVideo 720p, 129 frames (118800 tokens, 24 heads)": (118800, 24, 128, {}),
    "FLUX.1 1024² (4096 + 512 tokens, 24 heads)": (4608, 24, 128, {8: "2.49x eager, 4.10x compiled + graphs"}),
}
NODES = (1, 2, 4, 8)


def build(links: cost.Links) -> str:
    out = ["# Cost model: predicted attention-step speedup per layout (cp_ops.cost)", "",
           f"Links: NVLink {links.nvlink_gbps:g} GB/s per rank (measured, H200), network {links.network_gbps:g} GB/s per "
           f"rank (assumed: 400 Gb/s per GPU), latency {links.nvlink_latency_ms:g} / {links.network_latency_ms:g} ms "
           f"per collective (assumed), attention {links.attn_tflops:g} TFLOP/s (measured low end). bf16, B = 1, D = 128. "
           "Speedup = one-GPU attention ÷ the layout's attention step (transport-then-attend; 'overlapped': the AGKV "
           "hidden under attention, chunks ≥ 2). 'choice' = cost.choose (ring is predicted, not run by cp_ops). "
           "Bound = the zero-communication bound of the whole forward measured on one GPU (shared/anchors.md); "
           "'—' = not measured (W > 8 needs that run with a fake group of W ranks: left for the GPU runs).", ""]
    for model, (tokens, heads, d, bounds) in MODELS.items():
        out += [f"## {model}", "", "| GPUs | choice | " + " | ".join(["layout: speedup (overlapped)"] * 1) +
                " | bound |", "|---|---|---|---|"]
        for n in NODES:
            preds = cost.predict(tokens, heads, d, ranks_per_node=8, nodes=n, links=links)
            pick = cost.choose(tokens, heads, d, ranks_per_node=8, nodes=n, links=links)
            cells = ", ".join(f"{p.name} {p.speedup:.2f}x ({p.overlapped_speedup:.2f}x)" for p in preds)
            out.append(f"| {n}×8 | {pick.name} | {cells} | {bounds.get(8 * n, '—')} |")
        out.append("")
        out += [f"Bytes per rank per call at 2×8 ({model.split(' (')[0]}):", "",
                cost.table(cost.predict(tokens, heads, d, ranks_per_node=8, nodes=2, links=links), links), ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network-gbps", type=float, default=cost.Links.network_gbps)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    text = build(cost.Links(network_gbps=a.network_gbps))
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
