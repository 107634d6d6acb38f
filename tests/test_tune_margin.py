"""The measured choice's robustness rules (cp_ops.plan.measured): the margin (a candidate with more chunks, or the
mode other than the heuristic's, replaces a simpler one only when faster by more than tune.MARGIN), the median of
interleaved rounds (A B C A B C ..., so one drifted sample does not decide), the bounded schedule, and ranks
agreeing when their own timings differ. Pure rules on plain lists; the measuring path on 2 gloo ranks with the
timing function replaced (injected times; the warm-up calls and the chosen call run for real)."""

import statistics

import pytest
import torch

import cp_ops
from cp_ops.plan import measured as choices
from cp_ops.plan import measured as tune
from dist_util import run_ranks

A1, A2, A4, U1, U2 = ("agkv", 1), ("agkv", 2), ("agkv", 4), ("ulysses", 1), ("ulysses", 2)


# ---- pick: the margin rule ------------------------------------------------------------------------
def test_margin_keeps_the_simpler_variant_within_the_margin():
    assert tune.MARGIN == 0.03
    # agkv/2 2 % faster than agkv/1: within the margin, the simpler one (chunks=1) stays
    assert tune.pick([A1, A2], [1.00, 0.98], "agkv") == 0
    # 5 % faster: beyond the margin, the pipelined one is chosen
    assert tune.pick([A1, A2], [1.00, 0.95], "agkv") == 1
    # the case: chunks=2 measured 0.615 vs 0.469 for chunks=1 -> chunks=1 whichever is listed first
    assert tune.pick([A1, A2], [0.469, 0.615], "agkv") == 0
    assert tune.pick([A2, A1], [0.615, 0.469], "agkv") == 1
    # the bare minimum would pick index 1 in every case below; the margin decides otherwise
    assert tune.pick([A1, A2, A4], [1.00, 0.92, 0.90], "agkv") == 1  # agkv/4 only 2.2 % faster than agkv/2
    assert tune.pick([A1, A2, A4], [1.00, 0.96, 0.90], "agkv") == 2  # agkv/4 > 3 % faster than both
    # the margin argument overrides the constant; margin 0 is the bare minimum
    assert tune.pick([A1, A2], [1.00, 0.98], "agkv", margin=0.0) == 1
    assert tune.pick([A1, A2], [1.00, 0.95], "agkv", margin=0.10) == 0


def test_margin_prefers_the_heuristic_mode_at_equal_chunks_then_fewer_chunks():
    # Ulysses is the heuristic's mode (W divides H): AGKV must beat it by more than the margin
    assert tune.pick([A1, U1], [0.99, 1.00], "ulysses") == 1
    assert tune.pick([A1, U1], [0.95, 1.00], "ulysses") == 0
    assert tune.pick([A1, U1], [1.00, 0.99], "agkv") == 0
    # fewer chunks ranks before the mode: agkv/1 (non-default mode) beats ulysses/2 within the margin
    assert tune.pick([A1, U1, U2], [1.00, 1.20, 0.99], "ulysses") == 0
    # exact ties: the simplicity key, then the candidate order, so every rank picks the same one
    assert tune.pick([A2, A1], [1.0, 1.0], "agkv") == 1
    assert tune.pick([A1, ("agkv", 1)], [1.0, 1.0], "agkv") == 0


def test_margin_prefers_the_heuristic_candidate_within_the_margin():
    # the 2026-11-30c case at 32K: agkv/1 18.68 ms, agkv/2 18.65 ms (fast transport: the heuristic's agkv/2)
    assert tune.pick([A1, A2, A4], [18.68, 18.65, 18.90], "agkv", preferred=A2) == 1
    # within the margin but slower: the heuristic's candidate still wins the tie (2 % slower than agkv/1)
    assert tune.pick([A1, A2], [1.00, 1.02], "agkv", preferred=A2) == 1
    # without the preference (format 2's rule): the simplest within the margin
    assert tune.pick([A1, A2], [1.00, 1.02], "agkv") == 0
    # chunks=1 faster by more than the margin: 1, whatever the heuristic says
    assert tune.pick([A1, A2], [1.00, 1.04], "agkv", preferred=A2) == 0
    assert tune.pick([A2, A1], [1.04, 1.00], "agkv", preferred=A2) == 1
    # the heuristic's candidate beyond the margin: the rest keep today's order (simplest within the margin)
    assert tune.pick([A1, A2, A4], [1.00, 1.10, 0.99], "agkv", preferred=A2) == 0
    # a preferred candidate not among the candidates (deduplicated away): today's order
    assert tune.pick([A1, U1], [1.00, 0.99], "ulysses", preferred=A2) == 1
    # a list (as read back from JSON) matches like the tuple
    assert tune.pick([A1, A2], [1.00, 1.01], "agkv", preferred=["agkv", 2]) == 1


def test_schedule_is_bounded():
    # short calls: MAX_CALLS per sample, ROUNDS rounds, well under the budget
    calls, rounds = tune.schedule([0.05] * 6)
    assert calls == [tune.MAX_CALLS] * 6 and rounds == tune.ROUNDS
    # ~0.5 ms calls (S_local=2048 on H200): 20 calls a sample, rounds within the budget
    calls, rounds = tune.schedule([0.5] * 6)
    assert calls == [20] * 6 and rounds == tune.ROUNDS and rounds * 6 * 20 * 0.5 <= tune.BUDGET_MS
    # long calls: one call a sample, the budget caps the rounds, never below MIN_ROUNDS
    calls, rounds = tune.schedule([30.0] * 6)
    assert calls == [1] * 6 and rounds == tune.MIN_ROUNDS
    calls, rounds = tune.schedule([1.0, 4.0])
    assert calls == [10, 3] and rounds == min(tune.ROUNDS, int(tune.BUDGET_MS // 22.0))


# ---- the measuring path with injected timings, 2 gloo ranks ---------------------------------------
B, S_LOCAL, H, D = 1, 5, 6, 8


def _inputs(rank, w, seed, s_local=S_LOCAL):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, w * s_local, H, D, generator=g) for _ in range(3))
    sh = lambda t: t[:, rank * s_local:(rank + 1) * s_local].contiguous()  # noqa: E731
    return sh(q), sh(k), sh(v)


def _gather(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _Injected:
    """A timing function: ``table[cand]`` lists the times this rank reports for ``cand`` in order (the first
    is the sizing call); ``log`` records each call as (cand, calls)."""

    def __init__(self, table):
        self.table, self.log = table, []

    def __call__(self, cand, run, device, calls):
        k = sum(1 for c, _ in self.log if c == cand)
        self.log.append((cand, calls))
        seq = self.table[cand]
        return seq[min(k, len(seq) - 1)]


class _Drift(_Injected):
    """A timing function: ``base[cand]`` ms, times 1.5 for the first ``slow_steps`` timings of the measurement
    (whichever candidate they belong to)."""

    def __init__(self, base, slow_steps):
        super().__init__({})
        self.base, self.slow_steps = base, slow_steps

    def at(self, step, cand):
        return self.base[cand] * (1.5 if step < self.slow_steps else 1.0)

    def __call__(self, cand, run, device, calls):
        self.log.append((cand, calls))
        return self.at(len(self.log) - 1, cand)


def _decide(q, k, v, table, seed_note):
    """A fresh decision for mode='agkv', chunks=None under ``table`` (or an :class:`_Injected`): (choice, timer
    log)."""
    import torch.distributed as dist

    cp_ops.plan.forget()
    timer = table if isinstance(table, _Injected) else _Injected(table)
    tune._timer = timer
    out = cp_ops.attention(q, k, v, mode="agkv")
    c = choices.lookup("agkv", None, q, dist.group.WORLD, "torch")
    assert c is not None and c.source == "measured", (seed_note, c)
    # the output is the chosen variant's, bitwise (same kernels, same data)
    assert torch.equal(out, cp_ops.attention(q, k, v, mode=c.mode, chunks=c.chunks)), seed_note
    return c, timer.log


def _body(rank, w):
    from cp_ops import config

    config.configure(tune_modes=True, tune_cache="off")
    tune.WARMUP = 1
    q, k, v = _inputs(rank, w, 1)
    cands = tune.candidates("agkv", None, H, w)
    assert cands == [A1, A2, A4], cands

    # 1. interleaving: sizing once each (calls=1), then rounds of A B C in candidate order; median per candidate
    table = {A1: [1.0], A2: [2.0], A4: [4.0]}
    c, log = _decide(q, k, v, table, "order")
    calls, rounds = tune.schedule([1.0, 2.0, 4.0])
    assert rounds >= 3 and calls == [10, 5, 3], (calls, rounds)
    assert log == [(A1, 1), (A2, 1), (A4, 1)] + [(A1, 10), (A2, 5), (A4, 3)] * rounds, log
    assert (c.mode, c.chunks) == A1 and c.times_ms == {"agkv/1": 1.0, "agkv/2": 2.0, "agkv/4": 4.0}, c

    # 2. margin: agkv/2 2 % faster (every rank) -> agkv/1; 5 % faster -> agkv/2
    c, _ = _decide(q, k, v, {A1: [1.0], A2: [0.98], A4: [1.5]}, "within")
    assert (c.mode, c.chunks) == A1 and c.times_ms["agkv/2"] == 0.98, c
    c, _ = _decide(q, k, v, {A1: [1.0], A2: [0.95], A4: [1.5]}, "beyond")
    assert (c.mode, c.chunks) == A2, c

    # 3. drift: the machine runs 1.5x slow during the sizing calls and the first two rounds (clocks ramping,
    # another job ending). agkv/1 is truly 10 % faster than agkv/2. Interleaved, the slow period hits both alike
    # and the medians are the true times; timed one candidate after the other (the old order), agkv/1's samples
    # would all fall in the slow period (median 1.5 ms) and agkv/2 (1.1 ms) would be chosen.
    drift = _Drift({A1: 1.0, A2: 1.1, A4: 1.5}, slow_steps=len(cands) * 3)
    c, log = _decide(q, k, v, drift, "drift")
    assert (c.mode, c.chunks) == A1 and c.times_ms == {"agkv/1": 1.0, "agkv/2": 1.1, "agkv/4": 1.5}, c
    # the old order on the same clock: candidate i's sizing call at step i·(rounds + 1), its samples right after
    old = [statistics.median(drift.at(i * (rounds + 1) + 1 + r, x) for r in range(rounds)) for i, x in enumerate(cands)]
    assert old == [1.5, 1.1, 1.5] and tune.pick(cands, old, "agkv") == 1  # the wrong choice: agkv/2

    # 4. local timings differ: rank 0 alone sees agkv/2 10 % faster (it would pick it), rank 1 sees it 10 %
    # slower; the max over ranks (agkv/1 1.0, agkv/2 1.1) decides the same on both: agkv/1
    table = {A1: [1.0], A2: [0.9] if rank == 0 else [1.1], A4: [1.5]}
    local = [table[x][0] for x in cands]
    assert tune.pick(cands, local, "agkv") == (1 if rank == 0 else 0)  # alone, the ranks would disagree
    c, _ = _decide(q, k, v, table, "ranks differ")
    assert _gather((c.mode, c.chunks, tuple(sorted(c.times_ms.items())))) == [
        ("agkv", 1, (("agkv/1", 1.0), ("agkv/2", 1.1), ("agkv/4", 1.5)))] * w
    # ... and the other way round: rank 1 alone sees agkv/4 fastest, the group max still favours agkv/2 beyond
    # the margin, so both choose agkv/2
    table = {A1: [1.0], A2: [0.9], A4: [0.5] if rank == 1 else [1.2]}
    c, _ = _decide(q, k, v, table, "ranks differ 2")
    assert _gather((c.mode, c.chunks)) == [A2] * w, c

    # 5. the heuristic's candidate wins within the margin: with the table giving AGKV on this transport 2 stages
    # (as it does for the fast transport), agkv/2 2 % *slower* than agkv/1 is chosen; 5 % slower, agkv/1 is
    from cp_ops.plan import rules as pipelined

    saved = dict(pipelined.HEURISTIC_CHUNKS)
    pipelined.HEURISTIC_CHUNKS[("agkv", "torch")] = 2
    try:
        c, _ = _decide(q, k, v, {A1: [1.0], A2: [1.02], A4: [1.5]}, "heuristic within")
        assert (c.mode, c.chunks) == A2, c
        c, _ = _decide(q, k, v, {A1: [1.0], A2: [1.05], A4: [1.5]}, "heuristic beyond")
        assert (c.mode, c.chunks) == A1, c
    finally:
        pipelined.HEURISTIC_CHUNKS.clear()
        pipelined.HEURISTIC_CHUNKS.update(saved)


def test_measuring_interleaves_takes_the_median_applies_the_margin_and_ranks_agree():
    run_ranks(_body, 2)


@pytest.mark.parametrize("fmt", [1, 2, "missing"])
def test_disk_cache_of_another_format_is_ignored(tmp_path, fmt):
    import json

    from cp_ops import config

    path = tmp_path / "choices.json"
    data = {"entries": {"k": {"mode": "agkv", "chunks": 2}}}
    if fmt != "missing":
        data["format"] = fmt
    path.write_text(json.dumps(data))
    saved = config.snapshot()
    try:
        config.configure(tune_cache=str(path))
        assert choices.FORMAT == 3 and choices._read_cache() == {}
        choices._write_cache("k2", {"mode": "agkv", "chunks": 1})
        assert json.loads(path.read_text()) == {"format": 3, "entries": {"k2": {"mode": "agkv", "chunks": 1}}}
        assert choices._read_cache() == {"k2": {"mode": "agkv", "chunks": 1}}
    finally:
        config.restore(saved)


@pytest.mark.parametrize("entries", [[["k", {"mode": "agkv", "chunks": 2}]], {"k": "agkv/2", "ok": {"mode": "agkv",
                                     "chunks": 1}}, {"k": {"mode": "agkv", "chunks": 2, "times_ms": 3.0}}, "x", None])
def test_disk_cache_of_the_right_format_with_a_bad_shape_is_ignored(tmp_path, entries):
    """A format-3 file whose entries are not a dict of dicts (hand-edited, another tool's): those entries are
    ignored, as an unreadable file is — not an AttributeError on the rank holding the file (its peers would wait for
    it in the agreement's all-reduce until CP_OPS_TIMEOUT_S)."""
    import json

    from cp_ops import config

    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"format": 3, "entries": entries}))
    saved = config.snapshot()
    try:
        config.configure(tune_cache=str(path))
        # a dict with bad entries warns naming the file, other shapes say what 'entries' is
        warns = (r"malformed entries of the choice cache" if isinstance(entries, dict) else
                 r"its 'entries' is a .*, not a mapping")
        with pytest.warns(RuntimeWarning, match=warns):
            got = choices._read_cache()
        assert got == ({"ok": {"mode": "agkv", "chunks": 1}} if isinstance(entries, dict) and "ok" in entries else {})
        assert all(isinstance(e, dict) and isinstance(e.get("times_ms", {}), dict) for e in got.values())
        choices._write_cache("k2", {"mode": "agkv", "chunks": 1})  # a good entry replaces the bad ones
        assert choices._read_cache()["k2"] == {"mode": "agkv", "chunks": 1}
    finally:
        config.restore(saved)
