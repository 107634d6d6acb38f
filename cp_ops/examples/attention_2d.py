"""2-D CP attention across nodes: the cost model picks the (AGKV outer × Ulysses inner) split from the node layout,
cp_ops.attention runs on that mesh, and every rank checks its output against one device's.

Two nodes of 8 GPUs (run on each node; ``--node-rank`` 0 and 1)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        -m cp_ops.examples.attention_2d --tokens 32768 --heads 40

Two simulated nodes of 2 CPU ranks on one machine (two launches, one per "node")::

    CP_OPS_NODE_ID=node0 torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29500 -m cp_ops.examples.attention_2d --device cpu &
    CP_OPS_NODE_ID=node1 torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29500 -m cp_ops.examples.attention_2d --device cpu

Prints (rank 0) the node layout, each layout's prediction, the mesh chosen and the largest difference from one device.
``--mesh OxI`` takes a split instead of the cost model's.
"""

from __future__ import annotations

import argparse
import os


def mesh_arg(text: str) -> tuple[int, int]:
    """``--mesh``'s value 'OxI' (two ints >= 1) as ``(O, I)``; argparse.ArgumentTypeError naming the form else."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"takes OxI, two ints >= 1 (outer AGKV size x inner Ulysses size, e.g. 2x4); "
                                         f"got {text!r}")
    return int(parts[0]), int(parts[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="full sequence length S over all ranks (default 4096)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads H (the inner size must divide it)")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim D")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: one GPU per rank, NCCL; cpu: gloo ranks (try it on one machine)")
    ap.add_argument("--mesh", type=mesh_arg, default=None,
                    help="OxI: the split, O*I = the ranks launched (default: the cost model's choice)")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cp_ops
    from cp_ops import cost, layout, node
    from cp_ops.config import SAFE_ENV
    from cp_ops.mesh import DIM_NAMES, init_cp_mesh

    for key, val in SAFE_ENV.items():  # NVLink multicast / NVLS off
        os.environ.setdefault(key, val)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.device == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        ids = node.group_nodes(dist.group.WORLD)
        nodes, per = node.layout(ids)
        if a.mesh:
            o, i = a.mesh
            if o * i != world:  # every rank sees the same values: every rank stops here
                ap.error(f"--mesh {o}x{i} holds {o * i} ranks; this launch has {world}")
            mesh = init_device_mesh(dev.type, (o, i), mesh_dim_names=DIM_NAMES)
        else:
            mesh, pick = init_cp_mesh(a.tokens, a.heads, a.head_dim, device_type=dev.type,
                                      dtype="bf16" if dtype == torch.bfloat16 else "fp32")
        if rank == 0:
            print(f"{nodes} node(s) x {per} rank(s) (node ids: {sorted(set(ids))})")
            print(cost.table(cost.predict(a.tokens, a.heads, a.head_dim, ranks_per_node=per, nodes=nodes)))
            print(f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}")
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, a.tokens, a.heads, a.head_dim, generator=g).to(dev, dtype) for _ in range(3))
        sh = lambda t: layout.shard(t, 1, rank, world)  # noqa: E731
        out = cp_ops.attention(sh(q), sh(k), sh(v), group=mesh)
        ref = sh(cp_ops.local_attention(q, k, v))
        err = torch.tensor([(out.float() - ref.float()).abs().max().item()], device=dev)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"max |2-D CP - one device| over ranks: {err.item():.3g}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
