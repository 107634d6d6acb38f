"""Other libraries' context parallelism beside cp_ops (cp_ops.cli.bound_peers): ``cp-ops bound MODEL --compare
PEER[,PEER...]`` on the tiny configs, one CPU, fake groups of 2 ranks — each installed peer's rows, a refusal listed
with its reason (never raised), a peer's class patches kept to its own model, a missing peer named with its install
line — and each peer that runs on CPU parallelized on a real 2-rank gloo group against one device.

The peers: ``pip install -e .[test]`` installs para-attn and cache-dit (they run on CPU); xDiT (xfuser) needs an
accelerator (it raises at import without one): its CPU rows are refusals, its outputs are checked on one GPU
(tests/test_one_gpu_peers.py)."""

import argparse
import copy
import importlib.util
import math
import sys

import pytest
import torch
import torch.distributed as dist
import torch.utils._python_dispatch
from dist_util import run_ranks

from cp_ops.cli import bound, bound_fill, bound_peers
from cp_ops.cli.main import main
from cp_ops.cli.models import MODELS, build

HAS = {p.name: importlib.util.find_spec(p.module) is not None for p in bound_peers.PEERS.values()}


@pytest.fixture(autouse=True)
def _diffusers_attention_registry_restored():
    """cache-dit registers its attention backends into diffusers' registry for the whole process (its 'native' replaces
    diffusers'): each test here undoes what cache-dit registered (other registrations, cp_ops' own, stay), so the tests
    after it in this process run diffusers' own backends."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry as reg

    tables = ("_backends", "_constraints", "_supported_arg_names")
    saved = {k: dict(getattr(reg, k)) for k in tables}
    cp = copy.copy(reg._supports_context_parallel)
    members = set(AttentionBackendName._member_map_)
    yield
    ours = [b for b, fn in reg._backends.items() if getattr(fn, "__module__", "").startswith("cache_dit")]
    for b in ours:
        for k in tables:
            getattr(reg, k).pop(b, None)
            if b in saved[k]:
                getattr(reg, k)[b] = saved[k][b]
        if isinstance(cp, set):
            reg._supports_context_parallel.discard(b.value)
            reg._supports_context_parallel.update(cp & {b.value})
        else:
            reg._supports_context_parallel.pop(b, None)
            if b in cp:
                reg._supports_context_parallel[b] = cp[b]
        if b.name not in members:  # a member cache-dit added to diffusers' enum
            type.__delattr__(AttentionBackendName, b.name)  # Enum's own __delattr__ refuses members
            AttentionBackendName._member_map_.pop(b.name, None)
            AttentionBackendName._value2member_map_.pop(b.value, None)
            AttentionBackendName._member_names_.remove(b.name)
    envs = sys.modules.get("cache_dit.envs")
    if envs is not None:
        envs.ENV.CACHE_DIT_CUSTOM_ATTN_ALREADY_DISPATCH = False


def _needs(peer):
    return pytest.mark.skipif(not HAS[peer], reason=f"{peer} is not installed: {bound_peers.PEERS[peer].install}")


def _args(model, **kw):
    f, h, w = MODELS[model].cpu_latent
    base = dict(model=model, config="tiny", checkpoint=None, layers=None, frames=f, height=h, width=w,
                text_tokens=16, batch=1, dtype="fp32", mode="auto", chunks=1, bound=[2], bound_compile=["eager"],
                cost=False, no_group1=True, profile=None, warmup=0, repeats=1, out=None, unwritten=False, steps=0,
                compare=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_compare_peers_rows_and_refusals(monkeypatch):
    """FLUX tiny at W=2 with every peer: one row per peer and layout after cp_ops'. A peer that runs on CPU
    (para-attn and cache-dit Ulysses) is measured: finite bound, the full output shape, finite outputs, its
    all-to-alls written (two or more per attention); a refusal (ring on CPU: torch's ring attention and cache-dit's
    need CUDA; xDiT needs an accelerator or is not installed) is a row with a one-line reason, not an error.
    cache-dit replaces diffusers' 'native' attention backend in diffusers' registry on first use: the bound has it do
    so before the first side is built (compiled blocks built before would guard on the old registry and compile again
    in the timed rounds)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    order = []
    real = bound_peers.prepare
    monkeypatch.setattr(bound_peers, "prepare", lambda names: (order.append(("prepare", list(names))), real(names)))
    build = bound._prepare
    monkeypatch.setattr(bound, "_prepare", lambda s, *a, **k: (order.append(("build", s.name)), build(s, *a, **k))[1])
    rows = bound.run_bound(_args("flux", compare=["paraattn", "xdit", "cache-dit"]), torch.device("cpu"))
    assert not dist.is_initialized()
    assert order[:2] == [("prepare", ["paraattn", "xdit", "cache-dit"]), ("build", "diffusers")], order
    if HAS["cache-dit"]:
        native = _AttentionBackendRegistry._backends[AttentionBackendName("native")]
        assert native.__module__.startswith("cache_dit"), native
    assert [r["impl"] for r in rows] == ["cp_ops", "paraattn ulysses", "paraattn ring", "xdit ulysses", "xdit ring",
                                         "cache-dit ulysses", "cache-dit ring"]
    spec = MODELS["flux"]
    attn = sum(spec.configs["tiny"][k] for k in spec.layer_keys)
    by = {r["impl"]: r for r in rows}
    for impl in ("paraattn ulysses", "cache-dit ulysses"):
        r = by[impl]
        if not HAS[impl.split()[0]]:
            assert "not installed: pip install" in r["skipped"], r
            continue
        assert "skipped" not in r, r
        assert r["mode"] == "ulysses" and r["output_shape_ok"] and r["outputs_finite"] and "invalid" not in r, r
        assert math.isfinite(r["bound_speedup"]) and r["bound_speedup"] > 0 and r["fills"] >= 2 * attn, r
    for impl in ("paraattn ring", "xdit ulysses", "xdit ring", "cache-dit ring"):
        reason = by[impl]["skipped"]
        assert reason and "\n" not in reason and len(reason) < 400, by[impl]
    if not HAS["xdit"]:
        assert "pip install" in by["xdit ulysses"]["skipped"]


@_needs("paraattn")
def test_refused_model_is_a_row_not_an_error():
    """Qwen-Image has no para-attn adapter: its sides are rows with para-attn's own reason, cp_ops' row is measured;
    the results' markdown table (benchmarks/bound_table.py) names each refused side's W and impl."""
    from cp_ops.cli.bound_report import results_table

    rows = bound.run_bound(_args("qwenimage", compare=["paraattn"]), torch.device("cpu"))
    by = {r["impl"]: r for r in rows}
    assert math.isfinite(by["cp_ops"]["bound_speedup"])
    for impl in ("paraattn ulysses", "paraattn ring"):
        assert "QwenImageTransformer2DModel" in by[impl]["skipped"], by[impl]
    md = results_table(rows).splitlines()[2:]
    assert len(md) == 3 and all("| eager | 2 | paraattn " in ln and "failed: ValueError" in ln for ln in md[1:]), md


@_needs("paraattn")
def test_refused_side_in_a_compiled_mode_keeps_the_others_compiled(monkeypatch):
    """A peer side refused in a compiled mode (para-attn's ring on CPU) frees what it built without Dynamo's reset: the
    sides built before it keep their compiled code (a reset made every one compile again in the timed rounds: on a GPU
    tens of seconds per side, per refusal). compile_model is stubbed (no Inductor on CPU)."""
    from cp_ops.cli import run

    monkeypatch.setattr(run, "compile_model", lambda model, spec, args, overlap, kw_in=None: (model, 0))
    resets, at_rounds = [], []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    rounds = bound._time_sides
    monkeypatch.setattr(bound, "_time_sides", lambda *a, **k: (at_rounds.append(len(resets)), rounds(*a, **k))[1])
    rows = bound.run_bound(_args("flux", compare=["paraattn"], bound_compile=["regional"]), torch.device("cpu"))
    by = {r["impl"]: r for r in rows}
    assert by["paraattn ring"]["skipped"] and "skipped" not in by["paraattn ulysses"], rows
    assert at_rounds == [0], (at_rounds, resets)


@pytest.fixture
def fake_world_2():
    """The fake group of 2 ranks inside a fake default group of 4 (this process rank 0 of both), as the bound makes."""
    groups = bound.fake_groups([2, 4])
    yield groups[2]
    dist.destroy_process_group()


@_needs("cache-dit")
def test_class_patches_kept_to_the_peers_model(fake_world_2):
    """cache-dit sets WanAttnProcessor.__call__ for the whole process; parallelize keeps it to its own model: diffusers'
    class is unchanged after, another Wan model still runs diffusers' processor, the peer's model cache-dit's."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    own = WanAttnProcessor.__call__
    model, _ = build(MODELS["wan"], "tiny", None, "cpu", torch.float32)
    other, _ = build(MODELS["wan"], "tiny", None, "cpu", torch.float32)
    bound_peers.parallelize("cache-dit", model, "ulysses", fake_world_2, 2, torch.device("cpu"))
    assert WanAttnProcessor.__call__ is own
    proc = model.blocks[0].attn1.processor
    assert type(proc) is not WanAttnProcessor and isinstance(proc, WanAttnProcessor)
    assert type(proc).__call__ is not own
    assert type(other.blocks[0].attn1.processor) is WanAttnProcessor


@_needs("paraattn")
def test_paraattn_on_two_ranks_of_a_fake_world_of_four(fake_world_2):
    """W below the fake world's size (the bound's W = 2 inside its default group of max(W) ranks): para-attn's forward
    chunks its RoPE ids over the default group, which is the W-rank group while its side runs (world_of); the output
    has the full shape and is finite (the fake all-to-alls write real data)."""
    spec = MODELS["flux"]
    model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    f, h, w = spec.cpu_latent
    kw = spec.make_inputs(cfg, 16, 1, f, h, w, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = spec.predict(model, kw)
        built = bound_peers.parallelize("paraattn", model, "ulysses", fake_world_2, 4, torch.device("cpu"), kw)
        with built.around(), bound_fill.recording() as rec:
            out = spec.predict(model, kw)
    assert out.shape == ref.shape and torch.isfinite(out).all(), out.shape
    # its all-to-alls move W = 2 ranks' blocks: this rank's half of the joint (image + text) sequence, every head
    joint = (spec.tokens(cfg, f, h, w) + 16) // 2 * cfg["num_attention_heads"] * cfg["attention_head_dim"]
    a2a = [r for r in rec if r[0] == "alltoall_base"]
    assert a2a and all(r[2] == (joint,) for r in a2a), (joint, a2a)


@_needs("paraattn")
def test_paraattn_refuses_wan_with_the_reason(fake_world_2):
    """para-attn 0.3.38's Wan adapter chunks the RoPE as one complex tensor; diffusers >= 0.35 returns a (cos, sin)
    tuple, so every forward fails in para-attn itself (its adapter run directly, as its README does: AttributeError).
    The side refuses the model when it is built, with that reason in one line, instead of the bare AttributeError."""
    from para_attn.context_parallel import init_context_parallel_mesh
    from para_attn.context_parallel.diffusers_adapters import parallelize_transformer

    spec = MODELS["wan"]
    model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    f, h, w = spec.cpu_latent
    kw = spec.make_inputs(cfg, 16, 1, f, h, w, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"Wan adapter predates diffusers 0\.35's real-valued Wan RoPE") as e:
        bound_peers.parallelize("paraattn", model, "ulysses", fake_world_2, 4, torch.device("cpu"), kw)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300
    assert not getattr(model, "_is_parallelized", False)
    with bound_peers.world_of(fake_world_2), torch.no_grad():  # the reason is para-attn's own failure
        parallelize_transformer(model, mesh=init_context_parallel_mesh("cpu"))
        with pytest.raises(AttributeError, match="'tuple' object has no attribute 'shape'"):
            model(**kw)


def test_qwen_inputs_are_what_its_pipeline_passes():
    """Qwen-Image's pipeline (encode_prompt) drops an all-ones text mask (one prompt: every token valid): the tool's
    inputs carry none for one prompt, for every side alike (cp_ops, one device, the peers: with it, cache-dit's
    Ulysses failed on the mask's length and a whole-forward capture of xDiT's refused its host copy), and the
    pipeline's mask where prompts are padded."""
    from types import SimpleNamespace

    from diffusers import QwenImagePipeline

    spec = MODELS["qwenimage"]
    _, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    for batch in (1, 2):
        kw = spec.make_inputs(cfg, 16, batch, 1, 16, 16, torch.device("cpu"), torch.float32,
                              torch.Generator().manual_seed(batch))
        padded = torch.zeros(batch, 16, dtype=torch.long)
        for b in range(batch):
            padded[b, : 16 - b * 4] = 1
        _, want = QwenImagePipeline.encode_prompt(SimpleNamespace(), None, device="cpu",
                                                  prompt_embeds=kw["encoder_hidden_states"], prompt_embeds_mask=padded)
        got = kw["encoder_hidden_states_mask"]
        assert (got is None) == (want is None) == (batch == 1), (batch, want)
        if want is not None:
            assert torch.equal(got, want)


def test_split_lengths_are_the_streams_the_plan_splits():
    """What diffusers' _cp_plan splits, found by a forward stopped before the first block: Qwen-Image's image tokens
    and text (hidden states and RoPE tables), Wan's video tokens (RoPE and hidden states), FLUX's image and text."""
    from cp_ops.cli import bound_diffusers

    for name, text, (h, w) in (("qwenimage", 7, (18, 18)), ("wan", 16, (16, 16)), ("flux", 7, (16, 16))):
        spec = MODELS[name]
        model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
        f = spec.cpu_latent[0]
        kw = spec.make_inputs(cfg, text, 1, f, h, w, torch.device("cpu"), torch.float32, torch.Generator())
        tokens = spec.tokens(cfg, f, h, w)
        found = bound_diffusers.split_lengths(model, kw)
        want = {"qwenimage": {("transformer_blocks.0 hidden_states", tokens),
                              ("transformer_blocks.0 encoder_hidden_states", text),
                              ("pos_embed output 0", tokens), ("pos_embed output 1", text)},
                "wan": {("rope output 0", tokens), ("rope output 1", tokens), ("blocks.0 hidden_states", tokens)},
                "flux": {("hidden_states", tokens), ("encoder_hidden_states", text), ("img_ids", tokens),
                         ("txt_ids", text)}}[name]
        assert set(found) == want, (name, found)


@_needs("cache-dit")
def test_uneven_sequence_is_refused_with_its_lengths(fake_world_2):
    """Qwen-Image at 1328x1328 has 83 x 83 image tokens; here 9 x 9 = 81 (latent 18 x 18): cache-dit's and diffusers'
    even split refuse it (cache-dit's own assertion at the first forward, when it is parallelized as its README does);
    the sides refuse it when they are built, naming the length and where it is split."""
    import cache_dit
    from cache_dit import ParallelismConfig

    from cp_ops.cli import bound_diffusers

    spec = MODELS["qwenimage"]
    model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    kw = spec.make_inputs(cfg, 16, 1, 1, 18, 18, torch.device("cpu"), torch.float32, torch.Generator())
    why = r"W=2 does not divide 81 \(transformer_blocks\.0 hidden_states\): a cache-dit user"
    with pytest.raises(ValueError, match=why):
        bound_peers.parallelize("cache-dit", model, "ulysses", fake_world_2, 4, torch.device("cpu"), kw)
    with pytest.raises(ValueError, match=r"^diffusers' CP splits each sequence evenly.*W=2 does not divide 81"):
        bound_diffusers.require_even("diffusers", model, kw, 2)
    bound_diffusers.require_even("diffusers", model, kw, 1)  # a length W divides: nothing raised
    with bound_peers.world_of(fake_world_2), torch.no_grad():  # cache-dit itself, at the first forward
        cache_dit.enable_cache(model, parallelism_config=ParallelismConfig(ulysses_size=2))
        with pytest.raises(AssertionError, match="divisible by mesh size"):
            spec.predict(model, kw)


def test_diffusers_rows_name_the_uneven_lengths(monkeypatch):
    """diffusers' CP on Qwen-Image with 9 x 9 = 81 image tokens and 7 text tokens (as 1328x1328 and a real prompt give
    lengths no even W divides), the accelerator count patched to 1 (diffusers' CP runs on the CPU fake groups): both
    rows are refusals naming the lengths (81 image tokens, 7 text tokens) where diffusers splits them, in one line;
    cp_ops' row (it pads) is measured."""
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    rows = bound.run_bound(_args("qwenimage", compare=["diffusers"], height=18, width=18, text_tokens=7),
                           torch.device("cpu"))
    by = {r["impl"]: r for r in rows}
    assert math.isfinite(by["cp_ops"]["bound_speedup"]), by["cp_ops"]
    for impl in ("diffusers ulysses", "diffusers ring"):
        reason = by[impl]["skipped"]
        assert reason.startswith("ValueError: diffusers' CP splits each sequence evenly") and "\n" not in reason, reason
        assert "W=2 does not divide 81 (transformer_blocks.0 hidden_states), 7 (transformer_blocks.0 " \
               "encoder_hidden_states)" in reason, reason


@_needs("cache-dit")
def test_cachedit_qwen_row_is_measured():
    """cache-dit on Qwen-Image (W = 2, image and text lengths W divides): measured, with the pipeline's inputs (with
    the tool's all-ones text mask it failed: its plan does not split the mask); ring refused on CPU."""
    rows = bound.run_bound(_args("qwenimage", compare=["cache-dit"]), torch.device("cpu"))
    by = {r["impl"]: r for r in rows}
    r = by["cache-dit ulysses"]
    assert "skipped" not in r, r
    assert r["output_shape_ok"] and r["outputs_finite"] and math.isfinite(r["bound_speedup"]), r
    assert by["cache-dit ring"]["skipped"], by["cache-dit ring"]


def test_missing_peer_names_its_install_line(monkeypatch, fake_world_2):
    fake = bound_peers.Peer("nope", "cp_ops_no_such_module", "pip install nope==1.0", ("ulysses",), None)
    monkeypatch.setitem(bound_peers.PEERS, "nope", fake)
    with pytest.raises(RuntimeError, match=r"nope is not installed: pip install nope==1\.0"):
        bound_peers.parallelize("nope", torch.nn.Linear(2, 2), "ulysses", fake_world_2, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="layouts are ulysses; got 'ring'"):
        bound_peers.parallelize("nope", torch.nn.Linear(2, 2), "ring", fake_world_2, 2, torch.device("cpu"))


def test_compare_takes_only_known_peers(capsys):
    assert main(["bound", "flux", "--device", "cpu", "--worlds", "2", "--compare", "diffusers,ringflash"]) == 2
    text = capsys.readouterr()
    assert "--compare takes diffusers,paraattn,xdit,cache-dit; got ringflash" in text.err + text.out, text


def test_world_of_makes_the_w_group_the_default(fake_world_2):
    """While a peer builds or runs, its W-rank fake group is the default group (each README runs the peer on a world of
    W ranks); groups made inside write their outputs; the real default comes back after."""
    top = dist.group.WORLD
    assert dist.get_world_size() == 4
    with bound_peers.world_of(fake_world_2):
        assert dist.get_world_size() == 2 and dist.group.WORLD is fake_world_2
        g = dist.new_group([0, 1])
        assert bound_fill.is_filled(g)
    assert dist.group.WORLD is top and dist.get_world_size() == 4


def test_all_gather_into_tensor_is_written_and_recorded(fake_world_2):
    """dist.all_gather_into_tensor on a filled fake group (torch 2.13 calls ProcessGroup.all_gather_single, 2.11
    _allgather_base): this rank's data in every slot, one recorded write (xDiT gathers its output so)."""
    x = torch.randn(3, 4)
    out = torch.full((6, 4), float("nan"))
    with bound_fill.recording() as rec:
        dist.all_gather_into_tensor(out, x, group=fake_world_2)
    assert torch.equal(out[:3], x) and torch.equal(out[3:], x)
    assert [r[:3] for r in rec] == [("_allgather_base", (6, 4), (3, 4))]


class _Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the collectives (functional and c10d ops) a block dispatches."""

    def __enter__(self):
        self.count, self.names = 0, []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(w in name for w in ("all_to_all", "alltoall", "all_gather", "allgather")):
            self.count += 1
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def _peer_vs_one_device(rank, world, peer, model_name):
    """On each of ``world`` real gloo ranks: the tiny model parallelized by ``peer`` (Ulysses, the whole world as its
    group, as its README runs it) returns the full output of one device, within fp32 rounding (the same SDPA per head,
    other shapes)."""
    torch.manual_seed(0)
    spec = MODELS[model_name]
    model, cfg = build(spec, "tiny", None, "cpu", torch.float32)
    f, h, w = spec.cpu_latent
    g = torch.Generator().manual_seed(5)
    kw = spec.make_inputs(cfg, 16, 1, f, h, w, torch.device("cpu"), torch.float32, g)
    with torch.no_grad():
        ref = spec.predict(model, kw)
        built = bound_peers.parallelize(peer, model, "ulysses", dist.group.WORLD, spec.heads(cfg), torch.device("cpu"),
                                        kw)
        with built.around() if built.around else torch.no_grad(), _Collectives() as seen:
            out = spec.predict(model, kw)
    attn = sum(cfg[k] for k in spec.layer_keys)
    assert seen.count >= 2 * attn, (peer, seen.names)  # it did run parallel: an all-to-all in and out per attention
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, (peer, model_name, rank, err)


#: the peers that run on CPU, and the models each is checked on against one device
ON_CPU = (("paraattn", "flux"), ("cache-dit", "flux"), ("cache-dit", "wan"), ("cache-dit", "qwenimage"))


def _peers_vs_one_device(rank, world, cases):
    for peer, model_name in cases:
        _peer_vs_one_device(rank, world, peer, model_name)


def test_peer_outputs_equal_one_device_on_two_gloo_ranks():
    """para-attn (FLUX) and cache-dit (FLUX, Wan, Qwen-Image: called with its pipeline's inputs, the all-ones text
    mask dropped) Ulysses on a real 2-rank gloo group, in one pair of ranks (each case builds its own model); xDiT
    needs an accelerator (it raises at import without one): tests/test_one_gpu_peers.py
    checks it, and every peer, on ranks sharing one GPU."""
    cases = [c for c in ON_CPU if HAS[c[0]]]
    if not cases:
        pytest.skip(f"no peer that runs on CPU is installed: {bound_peers.PEERS['paraattn'].install}")
    run_ranks(_peers_vs_one_device, 2, cases, timeout=120)


def test_gpu_one_peers_section_runs_the_peer_steps(tmp_path):
    """benchmarks/gpu_one.sh OUT peers: the carried peer wheels (.whl_peers/) installed with the others in one pip call,
    then the one-GPU peer tests and the FLUX bound with every peer (benchmarks/gpu_steps.sh's tpeers, peers_flux); run
    with stand-ins for python3 and nvidia-smi (tests/test_gpu_scripts.py)."""
    import shutil
    import subprocess

    from test_gpu_scripts import _installs, _tree

    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and timeout")
    root, env = _tree(tmp_path)
    (root / ".whl_peers").mkdir()
    (root / ".whl_peers" / "para_attn-0.3.38-py3-none-any.whl").write_bytes(b"")
    r = subprocess.run(["bash", "benchmarks/gpu_one.sh", str(tmp_path / "out"), "peers"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls.log").read_text()
    assert [i for i in _installs(tmp_path) if ".whl_peers/para_attn" in i and ".whl/fake" in i], calls
    assert len(_installs(tmp_path)) == 1, calls
    assert "tests/test_one_gpu_peers.py" in calls, calls
    assert "-m cp_ops bound flux --worlds 2,4,8 --compile-modes eager,eager+graphs --compare " \
           "diffusers,paraattn,xdit,cache-dit" in calls, calls
    assert "out/peers/json/peers_flux.json" in calls, calls
