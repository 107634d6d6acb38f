"""A/B of cp_ops.layout's eager Ulysses layout copies on one GPU (2026-12-01e): rows moved as wide integers
(layout.wide, this tree) against the same copies in the tensors' own dtype (the code before). Device time per call
(50 calls captured in one CUDA graph, median of 5 replays), bf16, shapes of the bound's rows.
    python pack_ab.py OUT.json"""
import json
import sys

import torch

from cp_ops import layout
from cp_ops.timing import Graphed, time_ms


def pack_narrow(xs, w):  # ulysses_pack before layout.wide (heads lo=0, hi=Hl)
    b, s, h, d = xs[0].shape
    hl = h // w
    views = [x.as_strided((w, b, s, hl, d), (hl * x.stride(2), x.stride(0), x.stride(1), x.stride(2), x.stride(3)),
                          x.storage_offset()) for x in xs]
    return torch.stack(views, dim=3)


def unpack_narrow(buf):
    w, b, s, hl, d = buf.shape
    return buf.permute(1, 2, 0, 3, 4).clone(memory_format=torch.contiguous_format).view(b, s, w * hl, d)


def dev_us(fn, calls=50):
    g = Graphed(lambda: [fn() for _ in range(calls)][-1], torch.device("cuda"), warmup=2)
    return 1e3 * time_ms(g, torch.device("cuda"), 2, 5) / calls


rows = []
dev = torch.device("cuda")
for name, w, s, h, n in [("flux W8", 8, 576, 24, 2), ("flux W8", 8, 576, 24, 1), ("flux W4", 4, 1152, 24, 2),
                         ("qwenimage W4", 4, 1723, 24, 2), ("qwenimage W8", 8, 862, 24, 2),
                         ("wan14b 480p W4", 4, 8190, 40, 2), ("wan14b 480p W8", 8, 4095, 40, 1)]:
    xs = [torch.randn(1, s, h, 128, device=dev, dtype=torch.bfloat16) for _ in range(n)]
    assert torch.equal(layout.ulysses_pack(xs, w).view(torch.int16), pack_narrow(xs, w).view(torch.int16))
    new, old = dev_us(lambda: layout.ulysses_pack(xs, w)), dev_us(lambda: pack_narrow(xs, w))
    rows.append(dict(copy="ulysses_pack", case=name, n=n, mb=n * s * h * 256 / 2**20, wide_us=new, narrow_us=old))
    buf = torch.randn(w, 1, s, h // w, 128, device=dev, dtype=torch.bfloat16)
    if n == 2:
        new, old = dev_us(lambda: layout.ulysses_inverse_unpack(buf)), dev_us(lambda: unpack_narrow(buf))
        rows.append(dict(copy="ulysses_inverse_unpack (eager)", case=name, n=1, mb=s * h * 256 / 2**20, wide_us=new,
                         narrow_us=old))
for r in rows:
    print(f"{r['copy']:<32} {r['case']:<16} n={r['n']} {r['mb']:6.1f} MB  wide {r['wide_us']:7.2f} us  "
          f"narrow {r['narrow_us']:7.2f} us  ({r['narrow_us'] / r['wide_us']:.2f}x)")
json.dump(dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, rows=rows), open(sys.argv[1], "w"), indent=1)
