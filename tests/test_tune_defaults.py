"""Reproducible by default (cp_ops.plan.measured):

* ``mode='auto'`` / ``chunks=None`` take the documented heuristic unless measuring is asked for
  (``CP_OPS_TUNE_MODES=1`` or ``config.configure(tune_modes=True)``): nothing timed, nothing read or written under
  the cache folder, the output bitwise the explicit heuristic variant's;
* a mangled choice cache on one rank (JSON nested too deep to parse, entries of wrong types) is ignored with a
  warning naming the file, and every rank measures alike: no RecursionError on that rank while its peers wait;
* the measured choice times what its caller gives it (``runner``), not only the built-in synthetic call.
"""

import json
import os
import warnings

import pytest
import torch

import cp_ops
from cp_ops.plan import measured as choices
from cp_ops import config
from cp_ops.plan import measured as tune
from dist_util import run_ranks

B, S_LOCAL, H, D = 1, 5, 6, 8


def _inputs(rank, w, seed, h=H):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, w * S_LOCAL, h, D, generator=g) for _ in range(3))
    sh = lambda t: t[:, rank * S_LOCAL:(rank + 1) * S_LOCAL].contiguous()  # noqa: E731
    return sh(q), sh(k), sh(v)


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def test_measuring_is_opt_in():
    assert config.from_env({}).tune_modes is False
    assert config.from_env({"CP_OPS_TUNE_MODES": "1"}).tune_modes is True
    assert config.from_env({"CP_OPS_TUNE_MODES": "0"}).tune_modes is False


def _default_body(rank, w, home):
    import torch.distributed as dist

    from cp_ops import modes

    os.environ["HOME"] = os.environ["XDG_CACHE_HOME"] = os.path.join(home, f"rank{rank}")
    os.makedirs(os.environ["HOME"])
    assert config.settings.tune_modes is False and config.settings.sources["tune_modes"] == "default"
    tune._timer = lambda *a: pytest.fail("timed a candidate with measuring off")
    q, k, v = _inputs(rank, w, 3)
    outs = [cp_ops.attention(q, k, v) for _ in range(2)]
    c = choices.lookup("auto", None, q, dist.group.WORLD, "torch")
    assert (c.mode, c.chunks, c.source) == (cp_ops.choose_mode("auto", H, w), 1, "heuristic") == ("agkv", 1, "heuristic"), c
    assert choices.stats["measured"] == choices.stats["timed"] == choices.stats["cached"] == 0, choices.stats
    explicit = cp_ops.attention(q, k, v, mode="agkv", chunks=1)
    assert torch.equal(outs[0], explicit) and torch.equal(outs[1], explicit)
    cp_ops.attention(q, k, v, mode="agkv")  # chunks=None alone: the heuristic too
    assert choices.lookup("agkv", None, q, dist.group.WORLD, "torch").source == "heuristic"
    written = [os.path.join(d, f) for d, _, fs in os.walk(home) for f in fs]
    assert written == [], written  # nothing under ~/.cache (or anywhere under HOME)
    assert _gather((c.mode, c.chunks)) == [("agkv", 1)] * w


def test_default_is_the_heuristic_and_writes_no_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("CP_OPS_TUNE_MODES", raising=False)
    monkeypatch.delenv("CP_OPS_TUNE_CACHE", raising=False)
    run_ranks(_default_body, 2, str(tmp_path))


_DEEP = "[" * 200_000 + "]" * 200_000  # parses nowhere: json's decoder raises RecursionError


def test_unparsable_or_wrongly_typed_cache_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / "choices.json"
    good = {"mode": "agkv", "chunks": 2, "times_ms": {"agkv/1": 1.0, "agkv/2": 0.9}}
    bad = [{"mode": 3, "chunks": 1}, {"mode": "agkv", "chunks": "2"}, {"mode": "agkv", "chunks": True},
           {"mode": "agkv", "chunks": 0}, {"mode": "agkv", "chunks": 1, "times_ms": {"agkv/1": "fast"}},
           {"mode": "agkv", "chunks": 1, "times_ms": {"agkv/1": [[[1.0]]]}}, {"mode": [["agkv"]], "chunks": 1},
           {"mode": "agkv", "chunks": 1, "times_ms": {"agkv/1": float("nan")}}]
    saved = config.snapshot()
    choices._warned.clear()
    try:
        config.configure(tune_cache=str(path))
        path.write_text(json.dumps({"format": choices.FORMAT, "entries": {"ok": good, **{f"b{i}": e for i, e in
                                                                                       enumerate(bad)}}}))
        with pytest.warns(RuntimeWarning, match=f"ignoring {len(bad)} malformed entries of the choice cache {path}"):
            assert choices._read_cache() == {"ok": good}
        choices._warned.clear()
        path.write_text(json.dumps({"format": choices.FORMAT, "entries": [good]}))  # the right format, no mapping
        with pytest.warns(RuntimeWarning, match=f"ignoring the choice cache {path}: its 'entries' is a list"):
            assert choices._read_cache() == {}
        choices._warned.clear()
        path.write_text(_DEEP)
        with pytest.warns(RuntimeWarning, match=f"ignoring the choice cache {path}, which does not parse "
                                                r"\(RecursionError"):
            assert choices._read_cache() == {}
        choices._write_cache("k", good)  # the next write replaces the mangled file
        assert json.loads(path.read_text()) == {"format": choices.FORMAT, "entries": {"k": good}}
    finally:
        config.restore(saved)
        choices._warned.clear()


def _mangled_body(rank, w, tmp):
    import torch.distributed as dist

    tune.WARMUP, tune.ROUNDS, tune.MIN_ROUNDS, tune.SAMPLE_MS = 1, 1, 1, 1.0
    path = os.path.join(tmp, f"rank{rank}.json")
    if rank == 1:
        with open(path, "w") as f:
            f.write(_DEEP)
    config.configure(tune_modes=True, tune_cache=path)
    q, k, v = _inputs(rank, w, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cp_ops.attention(q, k, v, mode="agkv")
    msgs = [str(x.message) for x in caught if issubclass(x.category, RuntimeWarning)]
    assert any(path in m and "RecursionError" in m for m in msgs) == (rank == 1), msgs
    c = choices.lookup("agkv", None, q, dist.group.WORLD, "torch")
    assert c.source == "measured" and choices.stats["measured"] == 1, (c, choices.stats)  # every rank measured alike
    assert _gather((c.mode, c.chunks)) == [(c.mode, c.chunks)] * w
    assert torch.equal(out, cp_ops.attention(q, k, v, mode=c.mode, chunks=c.chunks))
    assert json.load(open(path))["format"] == choices.FORMAT  # rewritten, well-formed

    # the runner comes from the caller: decide() times the calls it is given, not the built-in synthetic ones
    cp_ops.plan.forget()
    config.configure(tune_cache="off")
    ran = []

    def runner(mode, chunks):
        def run():
            ran.append((mode, chunks))
            return cp_ops.attention(q, k, v, mode=mode, chunks=chunks)  # the caller's own tensors

        return run

    got = choices.decide("agkv", None, "agkv", q, dist.group.WORLD, "torch", runner=runner)[:2]
    cands = tune.candidates("agkv", None, H, w)
    assert got in cands and set(ran) == set(cands), (got, ran)
    assert _gather(got) == [got] * w


def test_mangled_cache_on_one_rank_and_the_callers_runner(tmp_path, monkeypatch):
    monkeypatch.setenv("CP_OPS_TIMEOUT_S", "30")  # before the fix rank 0 waited for rank 1 until this bound
    run_ranks(_mangled_body, 2, str(tmp_path), timeout=180)


def test_a_held_cache_lock_is_waited_for_a_bounded_time(tmp_path):
    """A choice-cache write whose lock another holder keeps (a hung process) gives up after ``settings.timeout_s``
    with a warning naming the file, instead of waiting forever."""
    import threading

    from cp_ops._file_lock import file_lock

    saved = config.snapshot()
    path = tmp_path / "choices.json"
    seen = []
    try:
        config.configure(tune_cache=str(path), timeout_s=0.3)

        def write():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                choices._write_cache("k", {"mode": "agkv", "chunks": 1})
            seen.extend(str(w.message) for w in caught)

        with file_lock(str(path) + ".lock", 5.0, "the test's hold"):
            t = threading.Thread(target=write, daemon=True)
            t.start()
            t.join(5.0)
            assert not t.is_alive(), "the write waited for the held lock past settings.timeout_s"
        assert any(f"cannot write the choice cache {path}" in m and "waited 0.3 s" in m for m in seen), seen
        assert not path.exists()
    finally:
        config.restore(saved)
        choices._warned.clear()
