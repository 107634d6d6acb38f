import sys, copy, torch
from dist_util import run_ranks
def body(rank, w, name, sizes):
    if rank == 0:
        torch._logging.set_logs(recompiles=True, graph_breaks=True)
    from diffusers_tiny import build, inputs, sample
    from cp_ops.integrations.diffusers import parallelize
    from torch._dynamo.testing import CompileCounterWithBackend
    model = build(name)
    cp_model = parallelize(copy.deepcopy(model), mode="agkv", transport="torch")
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(cp_model, backend=counter, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(4)
    for size in sizes:
        kw = inputs(name, 1, size, 7, g)
        with torch.no_grad():
            out = sample(compiled(**kw)); ref = sample(model(**kw))
        if rank == 0: print("frames", counter.frame_count, ((out-ref).abs().max()/ref.abs().max()).item(), flush=True)
if __name__ == "__main__":
    run_ranks(body, 2, sys.argv[1], eval(sys.argv[2]))
