"""The measured choice of mode='auto' / chunks=None (cp_ops.plan.measured decides and stores) on real gloo groups:
every rank picks the same variant (times max-reduced), the choice is measured once then cached, the disk cache
round-trips under a key naming the machine and the call, a rank whose file differs measures with the others
(no desync), the switch off gives the heuristic, explicit mode/chunks are honoured, and the output equals the
reference (chunks=1 bitwise, pipelined ≤ 1e-5 fp32). GPU (marked): bf16, 2 ranks, identical choice."""

import json
import os

import pytest
import torch

import cp_ops
from cp_ops.plan import measured as choices
from dist_util import run_ranks

B, S_LOCAL, H, D = 1, 5, 6, 8  # S_local odd; W = 2 and 3 divide H (Ulysses is a candidate)


def _rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _inputs(rank, w, seed, h=H):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, w * S_LOCAL, h, D, generator=g) for _ in range(3))
    ref = cp_ops.local_attention(q, k, v)
    sh = lambda t: t[:, rank * S_LOCAL:(rank + 1) * S_LOCAL].contiguous()  # noqa: E731
    return sh(q), sh(k), sh(v), sh(ref)


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _check_output(out, q, k, v, ref, choice):
    """chunks=1: bitwise equal to the explicit transport-then-attend call; pipelined: ≤ 1e-5 vs one device."""
    if choice.chunks == 1:
        assert torch.equal(out, cp_ops.attention(q, k, v, mode=choice.mode, chunks=1)), choice
    else:
        assert _rel(out, ref) <= 1e-5, (choice, _rel(out, ref))


def _fast_timing(tune):
    """Short measurements (the real timer, fewer and shorter samples): these are correctness tests."""
    tune.WARMUP, tune.ROUNDS, tune.MIN_ROUNDS, tune.SAMPLE_MS = 1, 1, 1, 1.0


def _favour(target):
    """A timer under which each rank alone would pick a different candidate (its own index), but the max over
    ranks picks ``target``: rank r reports 1 ms for candidate r, 1.5 ms for ``target``, 2 ms for the rest."""
    import torch.distributed as dist

    from cp_ops.plan import measured as tune

    def timer(cand, run, device, calls):
        run()  # the candidate must run (same calls on every rank)
        i = tune_cands[0].index(cand)
        return 1.5 if i == target else 1.0 if i == dist.get_rank() else 2.0

    tune_cands = [None]
    return timer, tune_cands, tune


def _body_w2(rank, w, tmp):
    import torch.distributed as dist

    from cp_ops import config, modes
    from cp_ops.plan import measured as tune

    _fast_timing(tune)
    config.configure(tune_modes=True, tune_cache=os.path.join(tmp, f"rank{rank}.json"))
    pg = dist.group.WORLD
    q, k, v, ref = _inputs(rank, w, 1)

    # 1. real timing: measured once, the same choice on every rank, output = reference
    out = cp_ops.attention(q, k, v)
    cands = tune.candidates("auto", None, H, w)
    assert cands == [("agkv", 1), ("agkv", 2), ("agkv", 4), ("ulysses", 1), ("ulysses", 2), ("ulysses", 4)], cands
    assert tune.candidates("auto", None, 4, w)[3:] == [("ulysses", 1), ("ulysses", 2)]  # H/W=2: ulysses/4 = /2
    assert choices.stats["measured"] == 1 and choices.stats["timed"] == len(cands), choices.stats
    choice = choices.lookup("auto", None, q, pg, "torch")
    assert choice.source == "measured" and set(choice.times_ms) == {f"{m}/{c}" for m, c in cands}
    assert len(set(_gather((choice.mode, choice.chunks, tuple(sorted(choice.times_ms.items())))))) == 1
    _check_output(out, q, k, v, ref, choice)
    for _ in range(3):  # cached: no more measuring
        assert torch.equal(cp_ops.attention(q, k, v), out)
    assert choices.stats["measured"] == 1 and choices.stats["timed"] == len(cands)

    # 2. explicit mode and chunks honoured: explicit both = no decision; a named mode keeps its name
    assert choices.decide("ulysses", 2, "ulysses", q, pg, "torch")[:2] == ("ulysses", 2)
    cp_ops.attention(q, k, v, mode="agkv", chunks=4)
    assert choices.stats["timed"] == len(cands)
    out_u = cp_ops.attention(q, k, v, mode="ulysses")  # chunks measured among ulysses 1, 2, 4 only
    cu = choices.lookup("ulysses", None, q, pg, "torch")
    assert cu.mode == "ulysses" and set(cu.times_ms) == {"ulysses/1", "ulysses/2", "ulysses/4"}, cu
    assert choices.stats["timed"] == len(cands) + 3, choices.stats
    _check_output(out_u, q, k, v, ref, cu)
    out_a = cp_ops.attention(q, k, v, chunks=1)  # mode measured at chunks=1
    ca = choices.lookup("auto", 1, q, pg, "torch")
    assert ca.chunks == 1 and set(ca.times_ms) == {"agkv/1", "ulysses/1"} and len(set(_gather(ca.mode))) == 1
    _check_output(out_a, q, k, v, ref, ca)

    # 3. max over ranks decides: each rank alone would pick its own index; the group picks agkv/2 (pipelined)
    q2, k2, v2, ref2 = _inputs(rank, w, 2, h=4)  # a new shape (H=4): a new decision
    cands2 = tune.candidates("auto", None, 4, w)
    target = cands2.index(("agkv", 2))
    timer, holder, _ = _favour(target)
    holder[0] = cands2
    tune._timer = timer
    out2 = cp_ops.attention(q2, k2, v2)
    c2 = choices.lookup("auto", None, q2, pg, "torch")
    assert (c2.mode, c2.chunks) == ("agkv", 2) and c2.times_ms["agkv/2"] == 1.5, c2
    assert all(t == 2.0 for n, t in c2.times_ms.items() if n != "agkv/2"), c2.times_ms
    _check_output(out2, q2, k2, v2, ref2, c2)

    # 4. disk cache: the entry is keyed by the machine and the call; a fresh process state reads it back
    entries = json.load(open(os.path.join(tmp, f"rank{rank}.json")))["entries"]
    key = next(kk for kk in entries if json.loads(kk)["H"] == 4)
    kd = json.loads(key)
    assert kd["device"].startswith("cpu:") and kd["torch"] == torch.__version__ and kd["cp_ops"] == cp_ops.__version__
    assert (kd["W"], kd["B"], kd["S_local"], kd["D"], kd["dtype"], kd["transport"]) == (w, B, S_LOCAL, D, "float32",
                                                                                          "torch")
    assert kd["candidates"] == [f"{m}/{c}" for m, c in cands2] and entries[key]["mode"] == "agkv"
    cp_ops.plan.forget()
    tune._timer = lambda *a: pytest.fail("measured although every rank holds the same cached choice")
    measured = choices.stats["measured"]
    assert torch.equal(cp_ops.attention(q2, k2, v2), out2)
    assert choices.stats["measured"] == measured and choices.lookup("auto", None, q2, pg, "torch").source == "cached"

    # 5. one rank's file differs (stale: another candidate): every rank measures again, none desyncs
    cp_ops.plan.forget()
    if rank == 1:
        path = os.path.join(tmp, "rank1.json")
        data = json.load(open(path))
        data["entries"][key]["mode"], data["entries"][key]["chunks"] = "ulysses", 1
        json.dump(data, open(path, "w"))
    timer, holder, _ = _favour(target)
    holder[0] = cands2
    tune._timer = timer
    out3 = cp_ops.attention(q2, k2, v2)
    assert choices.stats["measured"] == measured + 1, choices.stats  # on both ranks, rank 0's file agreeing or not
    assert _gather(choices.lookup("auto", None, q2, pg, "torch")[:2]) == [("agkv", 2)] * w
    assert torch.equal(out3, out2)
    assert json.load(open(os.path.join(tmp, f"rank{rank}.json")))["entries"][key]["mode"] == "agkv"  # rewritten
    # ... and one rank without a file at all
    cp_ops.plan.forget()
    if rank == 0:
        os.remove(os.path.join(tmp, "rank0.json"))
    out4 = cp_ops.attention(q2, k2, v2)
    assert choices.stats["measured"] == measured + 2 and torch.equal(out4, out2)

    # 6. switch off: the heuristic (AGKV at W = 2, chunks 1 on torch), bitwise the explicit call, nothing measured
    config.configure(tune_modes=False)
    q3, k3, v3, ref3 = _inputs(rank, w, 3)
    out5 = cp_ops.attention(q3, k3, v3)
    c5 = choices.lookup("auto", None, q3, pg, "torch")
    assert (c5.mode, c5.chunks, c5.source) == (cp_ops.choose_mode("auto", H, w), 1, "heuristic") == ("agkv", 1, "heuristic")
    assert choices.stats["measured"] == measured + 2
    assert torch.equal(out5, cp_ops.attention(q3, k3, v3, mode="agkv", chunks=1))
    assert cp_ops.attention(q3, k3, v3, mode="agkv").shape == q3.shape
    assert choices.lookup("agkv", None, q3, pg, "torch")[:3] == ("agkv", 1, "heuristic")

    # 7. the switch differs between ranks: ValueError on both (the settings are compared first), no hang
    config.configure(tune_modes=rank == 0)
    with pytest.raises(ValueError, match="tune_modes"):  # a new shape: rank 0 would measure, rank 1 not
        cp_ops.attention(*_inputs(rank, w, 4, h=2)[:3])


def test_tune_w2(tmp_path):
    run_ranks(_body_w2, 2, str(tmp_path))


def _body_w3(rank, w, tmp):
    import torch.distributed as dist

    from cp_ops import config
    from cp_ops.plan import measured as tune

    _fast_timing(tune)
    config.configure(tune_modes=True, tune_cache=os.path.join(tmp, "shared.json"))  # one file for all ranks
    pg = dist.group.WORLD
    for h in (H, 4):  # 4 heads: W=3 does not divide them, AGKV only
        q, k, v, ref = _inputs(rank, w, 10 + h, h=h)
        out = cp_ops.attention(q, k, v)
        c = choices.lookup("auto", None, q, pg, "torch")
        assert c.source == "measured" and len(set(_gather((c.mode, c.chunks)))) == 1, c
        if h == 4:
            assert c.mode == "agkv" and set(c.times_ms) == {"agkv/1", "agkv/2", "agkv/4"}, c
        _check_output(out, q, k, v, ref, c)
    entries = json.load(open(os.path.join(tmp, "shared.json")))["entries"]
    assert len(entries) == 2  # three writers, one lock: both entries kept


def test_tune_w3(tmp_path):
    run_ranks(_body_w3, 3, str(tmp_path))


def _compiled(rank, w):
    from cp_ops import config, modes
    from cp_ops.plan import measured as tune

    config.configure(tune_modes=True, tune_cache="off")
    fn = torch.compile(lambda a, b, c: cp_ops.attention(a, b, c) * 2, fullgraph=True, dynamic=True)
    for seed, s_local in ((5, 5), (6, 7)):  # dynamic sizes: traced code takes the heuristic, measures nothing
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, s_local, H, D, generator=g) for _ in range(3))
        out = fn(q, k, v)
        assert choices.stats["measured"] == 0 and choices.stats["timed"] == 0, choices.stats
        assert torch.equal(out, cp_ops.attention(q, k, v, mode=cp_ops.choose_mode("auto", H, w), chunks=1) * 2)


def test_tune_under_compile_takes_the_heuristic():
    run_ranks(_compiled, 2)


def _compiled_table(rank, w):
    """The traced call's chunks=None reads the heuristic's table with the transport resolved ('torch' here; on a
    GPU 'auto' resolves to the group's transport): a table entry of 3 stages makes the traced call pipelined."""
    import torch.distributed as dist

    from cp_ops import config
    from cp_ops.plan import measured as tune, rules as pipelined
    from cp_ops.transport.base import concrete_name

    config.configure(tune_modes=False, tune_cache="off")
    assert concrete_name("auto", dist.group.WORLD.group_name, "cpu") == "torch"  # for_group's choice on gloo/CPU
    assert concrete_name("fast", dist.group.WORLD.group_name, "cpu") == "fast"  # an explicit name as is
    pipelined.HEURISTIC_CHUNKS[("agkv", "torch")] = 3
    q, k, v, ref = _inputs(rank, w, 11)
    assert _traces_pipelined(q, k, v, "torch")
    fn = torch.compile(lambda a, b, c: cp_ops.attention(a, b, c, mode="agkv") * 2, fullgraph=True)
    out = fn(q, k, v)
    assert torch.equal(out, cp_ops.attention(q, k, v, mode="agkv", chunks=3) * 2)
    assert not torch.equal(out, cp_ops.attention(q, k, v, mode="agkv", chunks=1) * 2)  # LSE merge: not bitwise
    assert _rel(out, ref * 2) <= 1e-5
    # eager with measuring off: the same table
    cp_ops.plan.forget()
    cp_ops.attention(q, k, v, mode="agkv")
    c = choices.lookup("agkv", None, q, dist.group.WORLD, "torch")
    assert (c.mode, c.chunks, c.source) == ("agkv", 3, "heuristic"), c
    del pipelined.HEURISTIC_CHUNKS[("agkv", "torch")]
    assert not _traces_pipelined(q, k, v, "torch")
    cp_ops.plan.forget()
    cp_ops.attention(q, k, v, mode="agkv")
    c = choices.lookup("agkv", None, q, dist.group.WORLD, "torch")
    assert (c.mode, c.chunks, c.source) == ("agkv", 1, "heuristic"), c


def test_heuristic_table_decides_traced_and_unmeasured_calls():
    run_ranks(_compiled_table, 2)


def _traces_pipelined(q, k, v, transport):
    """Whether ``cp_ops.attention(q, k, v, mode='agkv', transport=transport)`` (chunks=None), traced by
    torch.compile(fullgraph=True), calls the pipelined AGKV op (the heuristic gave chunks ≥ 2)."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, c: cp_ops.attention(a, b, c, mode="agkv", transport=transport), backend=backend,
                       fullgraph=True)
    fn(q, k, v)
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert any("cp_ops" in t for t in targets), targets
    return any("agkv_pipelined_attention" in t for t in targets)


def _gpu_traced(rank, w):
    """On GPUs a traced chunks=None call resolves transport='auto' for the group at trace time: pipelined AGKV (2
    stages) where the fast transport runs the group, 1 stage on torch (2026-11-30c table)."""
    from cp_ops import config
    from cp_ops.plan import rules as pipelined
    from cp_ops.transport import fast

    config.configure(tune_modes=True, tune_cache="off")
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(1, 1024, 8, 64, generator=g, device="cuda").bfloat16() for _ in range(3))
    fast_ok = fast.unavailable_reason("cuda") is None
    assert pipelined.HEURISTIC_CHUNKS == {("agkv", "fast"): 2}
    assert not _traces_pipelined(q, k, v, "torch")
    assert _traces_pipelined(q, k, v, "auto") == fast_ok
    if fast_ok:
        assert _traces_pipelined(q, k, v, "fast")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_traced_heuristic_on_gpus():
    run_ranks(_gpu_traced, 2, timeout=400.0, device="cuda")


def _gpu_body(rank, w):
    import torch.distributed as dist

    from cp_ops import config
    from cp_ops.plan import measured as tune
    from cp_ops.transport import fast

    config.configure(tune_modes=True, tune_cache="off")
    g = torch.Generator(device="cuda").manual_seed(9)
    b, s_local, h, d = 1, 2048, 40, 128
    q, k, v = (torch.randn(b, w * s_local, h, d, generator=g, device="cuda").bfloat16() for _ in range(3))
    ref = cp_ops.local_attention(q, k, v)
    sh = lambda t: t[:, rank * s_local:(rank + 1) * s_local].contiguous()  # noqa: E731
    for transport in ["torch"] + (["fast"] if fast.unavailable_reason("cuda") is None else []):
        out = cp_ops.attention(sh(q), sh(k), sh(v), transport=transport)
        c = choices.lookup("auto", None, sh(q), dist.group.WORLD, transport)
        everyone = _gather((c.mode, c.chunks, c.source))
        if rank == 0:
            print(f"tuned W={w} {transport} bf16 {[b, s_local, h, d]}: {c.mode} chunks={c.chunks} "
                  f"times {c.times_ms}", flush=True)
        assert len(set(everyone)) == 1 and c.source == "measured", everyone
        assert _rel(out, sh(ref)) <= 1e-2
        measured = choices.stats["measured"]
        cp_ops.attention(sh(q), sh(k), sh(v), transport=transport)
        assert choices.stats["measured"] == measured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tuned_choice_identical_on_gpus():
    os.environ.setdefault("CP_OPS_TIMEOUT_S", "120")
    run_ranks(_gpu_body, 2, timeout=400.0, device="cuda")


def _fp8_request(rank, w, tmp):
    """Measuring on, an FP8 call is its own request: timed moving FP8 (was: the candidates ran without comm_dtype) and
    kept apart from the plain call of the same shape (was: one stored choice for both, in memory and in the file)."""
    from cp_ops import config
    from cp_ops.kernels import fp8
    from cp_ops.plan import measured as tune

    _fast_timing(tune)
    path = os.path.join(tmp, f"rank{rank}.json")
    config.configure(tune_modes=True, tune_cache=path)
    encoded = []
    enc = fp8.encode_torch  # what every FP8 launch on CPU runs (fp8.encode)
    fp8.encode_torch = lambda x, fmt: encoded.append(fmt) or enc(x, fmt)
    e4 = torch.float8_e4m3fn
    q, k, v, _ = _inputs(rank, w, 41)
    cp_ops.attention(q, k, v, mode="agkv", comm_dtype=e4)  # measures, then runs
    first = len(encoded)
    cp_ops.attention(q, k, v, mode="agkv", comm_dtype=e4)  # the stored choice: runs only
    assert first > 2 * (len(encoded) - first), (first, len(encoded))  # the candidates' calls encoded too
    assert cp_ops.describe(q, mode="agkv", comm_dtype=e4).source == "measured"
    assert cp_ops.describe(q, mode="agkv").source == "pending"  # the plain call: not measured yet
    cp_ops.attention(q, k, v, mode="agkv")
    assert cp_ops.describe(q, mode="agkv").source == "measured"
    entries = json.load(open(path))["entries"]
    assert sorted(json.loads(key).get("comm", "") for key in entries) == ["", "q=e4m3,k=e4m3,v=e4m3,o=e4m3"]
    # mode='auto' measured to Ulysses where the heuristic says AGKV (W = 2): Q, K, V and O travel in FP8, as asked
    # (was: the formats of the heuristic's AGKV, K and V only)
    def timer(cand, run, device, calls):
        run()
        return 1.0 if cand == ("ulysses", 1) else 2.0

    tune._timer = timer
    cp_ops.attention(q, k, v, comm_dtype=e4)
    assert cp_ops.describe(q, comm_dtype=e4)[:3] == ("ulysses", 1, "measured")
    before = len(encoded)
    cp_ops.attention(q, k, v, comm_dtype=e4)
    assert len(encoded) - before == 4, encoded[before:]


def test_fp8_call_is_measured_apart(tmp_path):
    run_ranks(_fp8_request, 2, str(tmp_path))
