"""The same-call contract across the ranks of a CP group (cp_ops.contract): any disagreement raises on every
rank, naming what each rank called — never a crash, a hang or a computed result. Unsupported dtypes are a
clear error from the public API, the ops' real kernels and their fake kernels alike."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import cp_ops
from cp_ops import config
from dist_util import run_ranks

H, D = 12, 8  # W = 2, 3, 4 divide H (Ulysses)


def _shards(rank, w, s_local, seed):
    """q, k, v: this rank's block of a global [1, W*s_local, H, D] tensor, and the global k, v."""
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, w * s_local, H, D, generator=g) for _ in range(3)]
    loc = [x[:, rank * s_local:(rank + 1) * s_local].contiguous() for x in full]
    return loc, full


def _check_correct(rank, w, s_local, seed, mode):
    (q, k, v), (_, kf, vf) = _shards(rank, w, s_local, seed)
    out = cp_ops.attention(q, k, v, mode=mode)
    torch.testing.assert_close(out, cp_ops.local_attention(q, kf, vf), rtol=1e-5, atol=1e-5)


def _shape_switch(rank, w):
    last = w - 1
    for mode in ("agkv", "ulysses"):
        for s in (8, 16):  # both shapes are seen (and were "checked") on every rank
            _check_correct(rank, w, s, s, mode)
        # the last rank switches to the already-seen shape 8 while its peers keep 16
        s = 8 if rank == last else 16
        (q, k, v), _ = _shards(rank, w, s, 0)
        with pytest.raises(ValueError, match=rf"differ in shape: rank 0: cp_ops.attention \(call #\d+\) "
                                             rf"\[B, S_local, H, D\]=\[1, 16, {H}, {D}\].*rank {last}: .*=\[1, 8, {H}, {D}\]"):
            cp_ops.attention(q, k, v, mode=mode)
        # the direct op call (what compiled code runs) checks the same
        with pytest.raises(ValueError, match=rf"differ in shape.*\[1, 16, {H}, {D}\].*\[1, 8, {H}, {D}\]"):
            torch.ops.cp_ops.agkv_gather_start(k, v, w, dist.group.WORLD.group_name, "torch")
        # a send buffer packed by traced code ([W, B, S_local, n, H/W, D]) is compared as the [B, S_local, H, D] of
        # its inputs (contract.Like), so a compiled rank pairs with an eager one
        send = cp_ops.layout.ulysses_pack([q, k, v], w)
        with pytest.raises(ValueError, match=rf"differ in shape.*\[1, 16, {H}, {D}\].*\[1, 8, {H}, {D}\]"):
            torch.ops.cp_ops.ulysses_packed_start(send, w, dist.group.WORLD.group_name, "torch")
    # one rank calls AGKV, the others Ulysses, on the same shape
    (q, k, v), _ = _shards(rank, w, 8, 0)
    with pytest.raises(ValueError, match=rf"differ in .*variant.*rank 0: cp_ops.attention .*mode=agkv.*rank {last}: "
                                         rf"cp_ops.attention .*mode=ulysses"):
        cp_ops.attention(q, k, v, mode="ulysses" if rank == last else "agkv")
    # nothing computed, nothing left in flight: the group still works
    _check_correct(rank, w, 8, 3, "agkv")
    _check_correct(rank, w, 16, 4, "ulysses")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_switching_to_a_seen_shape_raise_on_every_rank(world_size):
    run_ranks(_shape_switch, world_size)


def _shape_switch_over(rank, w, use_shm):
    from cp_ops import contract

    contract._USE_SHM = use_shm
    _shape_switch(rank, w)
    st = contract._groups[dist.group.WORLD.group_name]
    # one host: the signature goes through shared memory (a few µs) unless told to use the gloo side group
    assert (st.shm is not None) == use_shm, (use_shm, st.shm)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "gloo"])
def test_both_exchanges_catch_a_rank_switching_shape(use_shm):
    run_ranks(_shape_switch_over, 2, use_shm)


def _settings_mismatch(rank, w):
    saved = config.snapshot()
    (q, k, v), _ = _shards(rank, w, 8, 0)
    try:
        config.configure(fast_path="ce" if rank == 0 else "sm")
        with pytest.raises(ValueError, match=r"differ in settings: rank 0: .* fast_path='ce'; rank 1: .* fast_path='sm'"):
            cp_ops.attention(q, k, v, mode="agkv")
        config.restore(saved)
        # the transport argument the op was given ('auto' here, 'torch' on the others): named per rank
        with pytest.raises(ValueError, match=r"differ in transport: rank 0: .* transport='auto'; rank 1: .* transport='torch'"):
            torch.ops.cp_ops.agkv_gather_start(k, v, w, dist.group.WORLD.group_name, "auto" if rank == 0 else "torch")
        # CP_OPS_CHECK_RANKS=off on one rank: the first call on a group still exchanges, so it is caught there
        group = dist.new_group(list(range(w)))
        config.configure(check_ranks="off" if rank == 0 else "on")
        with pytest.raises(ValueError, match=r"differ in settings: rank 0: .* check_ranks='off'; rank 1: .* check_ranks='on'"):
            cp_ops.attention(q, k, v, mode="agkv", group=group)
        # 'off' on every rank: only that first exchange, no more
        config.configure(check_ranks="off")
        n = cp_ops.contract.call_count(group)
        for _ in range(3):
            cp_ops.attention(q, k, v, mode="agkv", group=group)
        assert cp_ops.contract.call_count(group) == n
    finally:
        config.restore(saved)
    _check_correct(rank, w, 8, 5, "agkv")


def test_collective_settings_and_transport_must_match():
    run_ranks(_settings_mismatch, 2)


_BAD_DTYPES = (torch.float64, torch.float8_e4m3fn, torch.int32, torch.complex64)


def _dtypes(rank, w):
    q = torch.randn(1, 8, H, D)
    name = dist.group.WORLD.group_name
    for dt in _BAD_DTYPES:
        x = q.to(dt)
        msg = rf"must be float32, float16 or bfloat16 \(the dtypes cp_ops supports\); got {dt}"
        for call in (lambda: cp_ops.attention(x, x, x, mode="agkv"), lambda: cp_ops.attention(x, x, x, mode="ulysses"),
                     lambda: cp_ops.agkv_gather(x, x), lambda: cp_ops.ulysses_all_to_all(x, x),
                     lambda: cp_ops.ulysses_all_to_all_inverse(x),
                     lambda: torch.ops.cp_ops.agkv_gather_start(x, x, w, name, "torch"),
                     lambda: torch.ops.cp_ops.ulysses_start([x], w, name, "torch"),
                     lambda: torch.ops.cp_ops.ulysses_inverse_start(x, w, name, "torch")):
            with pytest.raises(ValueError, match=msg):
                call()
    # only rank 1 passes float64: it names its dtype, its peers name rank 1's error
    x = q.double() if rank == 1 else q
    with pytest.raises(ValueError, match="got torch.float64" if rank == 1 else
                       r"rank\(s\) \[1\] .*rejected their inputs.*got torch.float64"):
        cp_ops.attention(x, x, x)
    _check_correct(rank, w, 8, 6, "agkv")


def test_unsupported_dtypes_are_named_errors():
    run_ranks(_dtypes, 2)


def test_unsupported_dtypes_in_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        for dt in _BAD_DTYPES:
            x = torch.empty(1, 8, H, D, dtype=dt)
            msg = rf"must be float32, float16 or bfloat16.*got {dt}"
            with pytest.raises(ValueError, match=msg):
                torch.ops.cp_ops.agkv_gather_start(x, x, 2, "g", "torch")
            with pytest.raises(ValueError, match=msg):
                torch.ops.cp_ops.ulysses_start([x, x], 2, "g", "torch")
            with pytest.raises(ValueError, match=msg):
                torch.ops.cp_ops.ulysses_inverse_start(x, 2, "g", "torch")
        # the fake kernels use the same rules as the public API (same messages)
        x = torch.empty(1, 8, 3, D)  # 3 heads, W = 2
        with pytest.raises(ValueError, match="got heads=3, world_size=2"):
            torch.ops.cp_ops.ulysses_start([x], 2, "g", "torch")
        with pytest.raises(ValueError, match=r"k and v must have the same BSHD shape"):
            torch.ops.cp_ops.agkv_gather_start(torch.empty(1, 8, H, D), torch.empty(1, 4, H, D), 2, "g", "torch")


def _timeout(rank, w, done):
    saved = config.snapshot()
    config.configure(timeout_s=1)
    try:
        group = dist.new_group(list(range(w)))  # its side group gets the 1 s bound
        (q, k, v), _ = _shards(rank, w, 8, 0)
        cp_ops.attention(q, k, v, mode="agkv", group=group)
        if rank == 0:  # rank 1 never makes this call: rank 0 raises within the bound instead of hanging
            t0 = time.monotonic()
            try:
                with pytest.raises(RuntimeError, match=r"call #2 on CP group .*: rank 1 \(global rank 1.*\) did not "
                                                       r"arrive within CP_OPS_TIMEOUT_S=1 s"):
                    cp_ops.attention(q, k, v, mode="agkv", group=group)
                assert time.monotonic() - t0 < 30
            finally:
                open(done, "w").close()
        else:  # alive (its group up) until rank 0 is done, bounded
            t0 = time.monotonic()
            while not os.path.exists(done):
                assert time.monotonic() - t0 < 60, "rank 0 did not finish within 60 s"
                time.sleep(0.05)
    finally:
        config.restore(saved)


def test_a_missing_call_times_out_with_a_named_error(tmp_path):
    run_ranks(_timeout, 2, str(tmp_path / "rank0_done"))


# ---- through parallelize(): per-rank inputs, a skipped layer ---------------------------------
class _SkipAttention:
    """A processor that skips the CP attention call (as a rank-local cache would)."""

    def __call__(self, attn, hidden_states, *args, **kwargs):
        return hidden_states


def _parallelize_contract(rank, w, check_ranks):
    import copy

    from test_diffusers import _tiny_wan

    from cp_ops.integrations.diffusers import parallelize

    config.configure(check_ranks=check_ranks)
    model = _tiny_wan(heads=4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 2, 8, 8, generator=g)
    t = torch.tensor([500])
    text = torch.randn(1, 16, 32, generator=g)
    cp = parallelize(copy.deepcopy(model), mode="agkv", transport="torch")
    with torch.no_grad():
        ref = model(x, t, text).sample
        assert torch.equal(cp(x, t, text).sample, ref)
        # per-rank seeds: rank 1's latents differ (same shape as the forward above)
        x1 = x + 1e-3 * (rank == 1)
        if check_ranks in ("always", "debug"):  # every forward is checked
            with pytest.raises(ValueError, match=r"cp_ops.parallelize inputs: .*differ in inputs: rank 0: .*rank 1: .*"
                                                 r"input checksums differ: the ranks were given different inputs") as e:
                cp(x1, t, text)
            # the message names the input that differs, how it was passed, its shape and which ranks hold what
            assert ("input hidden_states (positional argument 0) differs in values (checksums) (rank 0: shape "
                    "[1, 4, 2, 8, 8] float32; rank 1: shape [1, 4, 2, 8, 8] float32)") in str(e.value), str(e.value)
            assert "input timestep" not in str(e.value) and "input encoder_hidden_states" not in str(e.value)
        # a new shape is checked under the default too
        x2 = torch.randn(1, 4, 4, 8, 8, generator=torch.Generator().manual_seed(2 + rank))
        with pytest.raises(ValueError, match="differ in inputs"):
            cp(x2, t, text)
        # per-rank text embeddings
        with pytest.raises(ValueError, match="differ in inputs") as e:
            cp(torch.randn(1, 4, 6, 8, 8, generator=torch.Generator().manual_seed(9)), t, encoder_hidden_states=text + rank)
        assert ("input encoder_hidden_states (keyword) differs in values (checksums) (rank 0: shape [1, 16, 32] "
                "float32; rank 1: shape [1, 16, 32] float32)") in str(e.value), str(e.value)
        assert "input hidden_states" not in str(e.value)
        # one line first: the forward, what differs and what to do, in at most ~250 characters; details after
        first = str(e.value).splitlines()[0]
        assert first.startswith("cp_ops.parallelize inputs of forward #") and len(first) < 250, first
        assert first.endswith("input encoder_hidden_states (keyword) differs in values (checksums): pass the same "
                              "tensors on every rank (seed the latents and noise alike)"), first
        # rank 1 skips the second layer's attention: every rank raises before the output gather
        skip = parallelize(copy.deepcopy(model), mode="agkv", transport="torch")
        if rank == 1:
            skip.blocks[1].attn1.set_processor(_SkipAttention())
        with pytest.raises(ValueError, match=r"differ in call.*rank 0: cp_ops.attention .*rank 1: "
                                             r"cp_ops.parallelize output gather \(calls this forward\)"):
            skip(x, t, text)
        # the group is healthy afterwards
        assert torch.equal(cp(x, t, text).sample, ref)


@pytest.mark.parametrize("check_ranks", ["on", "debug", "always"])  # always: the old spelling of debug
def test_parallelize_ranks_must_get_the_same_inputs_and_make_the_same_calls(check_ranks):
    pytest.importorskip("diffusers")
    run_ranks(_parallelize_contract, 2, check_ranks)


# ---- the softmax scale is part of the contract (it was not: ranks with different scales computed different math) ----
def _scale_mismatch(rank, w):
    (q, k, v), (_, kf, vf) = _shards(rank, w, 8, 7)
    # the same scale on every rank: the single-device attention with that scale (bitwise at chunks=1)
    for mode in ("agkv", "ulysses"):
        out = cp_ops.attention(q, k, v, mode=mode, scale=0.3, chunks=1)
        torch.testing.assert_close(out, cp_ops.local_attention(q, kf, vf, scale=0.3), rtol=0, atol=0)
    # eager: different scales (and one rank's default against another's value) raise on every rank, naming each
    for mine, peer in ((0.125, 0.25), (None, 0.25)):
        scale = mine if rank == 0 else peer
        with pytest.raises(ValueError, match=rf"differ in variant: rank 0: .*scale={mine}.*; rank 1: .*scale={peer}"
                                             rf".*different softmax scales \(rank 0: scale={mine}, rank 1: "
                                             rf"scale={peer}\): cp_ops.attention's scale must be the same on every rank"
                                             if mine is not None else
                                             rf"differ in variant: rank 0: .*; rank 1: .*scale={peer}.*different softmax "
                                             rf"scales \(rank 0: scale=None, rank 1: scale={peer}\)"):
            cp_ops.attention(q, k, v, mode="agkv", scale=scale)
    # not a number: TypeError on every rank (the rank's own), before anything moves
    with pytest.raises(TypeError, match=r"scale must be None \(1/sqrt\(D\)\) or a real number .*got str '0.5'"):
        cp_ops.attention(q, k, v, mode="agkv", scale="0.5")
    # compiled (traced by Dynamo; the eager backend: Inductor adds nothing here): the scale is a constant of each rank's
    # graph (a float that changes between calls is specialized: one graph per value), carried by the launch's exchange
    comp = torch.compile(lambda q, k, v, s: cp_ops.attention(q, k, v, mode="ulysses", scale=s) * 2, fullgraph=True,
                         backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(comp(q, k, v, 0.3), cp_ops.local_attention(q, kf, vf, scale=0.3) * 2,
                                   rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"differ in variant: rank 0: .*scale=0.3.*; rank 1: .*scale=0.5.*"
                                             r"different softmax scales"):
            comp(q, k, v, 0.3 if rank == 0 else 0.5)
    _check_correct(rank, w, 8, 8, "agkv")  # nothing left in flight: the group still works


def test_ranks_with_different_scales_raise_on_every_rank():
    run_ranks(_scale_mismatch, 2)


def _fp8_inputs_differ_in_dtype(rank, w, compiled):
    # FP8 on the wire: the launches move uint8 rows whatever the inputs' dtype, but O comes back in each rank's own
    # dtype; ranks whose inputs differ in dtype must be told so (the variant tag carries it), not crash in gloo
    dt = torch.bfloat16 if rank == w - 1 else torch.float32
    (q, k, v), _ = _shards(rank, w, 8, 0)
    q, k, v = (x.to(dt) for x in (q, k, v))

    def f(q, k, v):
        return cp_ops.attention(q, k, v, mode="ulysses", chunks=1, comm_dtype={"q": "e4m3", "k": "e4m3", "v": "e4m3"})

    if compiled:  # the contract is checked inside the launch: AOTAutograd's graph runs it as Inductor's would
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match=r"differ in .*variant.*input_dtype=float32.*input_dtype=bfloat16"):
        f(q, k, v)
    _check_correct(rank, w, 8, 6, "ulysses")  # the group still works


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_ranks_whose_inputs_differ_in_dtype_raise_on_every_rank(compiled):
    run_ranks(_fp8_inputs_differ_in_dtype, 2, compiled)


def _bad_seq_lens_on_one_rank(rank, w, bad):
    seq = [5, 3]
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, seq[rank], H, D, generator=g) for _ in range(3))
    t0 = time.monotonic()
    with pytest.raises(ValueError):  # the bad rank: its own rule; its peer: told by it in the exchange
        torch.ops.cp_ops.agkv_pipelined_attention(q, k, v, w, dist.group.WORLD.group_name, "torch", None, 2,
                                                  bad if rank == w - 1 else seq)
    assert time.monotonic() - t0 < 5, "a peer waited out the rank check's timeout"


@pytest.mark.parametrize("bad", [[], [5, 3, 4]], ids=["empty", "too_long"])
def test_bad_seq_lens_on_one_rank_of_the_pipelined_op_fail_every_rank_at_once(bad):
    run_ranks(_bad_seq_lens_on_one_rank, 2, bad)


def _failed_without_a_message(rank, w):
    """A rank whose own check failed with an exception that has no message (``KeyboardInterrupt()``,
    ``ValueError()``): its peers are told within the exchange, naming its error type; it returns to re-raise."""
    from cp_ops import contract

    q = torch.randn(1, 4, H, D, generator=torch.Generator().manual_seed(rank))
    t0 = time.monotonic()
    if rank == w - 1:
        assert contract.exchange(dist.group.WORLD, "agkv", "torch", q, failed=ValueError()) is None
    else:
        with pytest.raises(ValueError, match=r"ValueError"):
            contract.exchange(dist.group.WORLD, "agkv", "torch", q)
    assert time.monotonic() - t0 < 5, "a peer waited out the rank check's timeout"


def test_a_rank_failing_with_an_empty_message_is_named_at_once():
    run_ranks(_failed_without_a_message, 2)


# ---- the variant words are 64-bit digests: two layers whose 31-bit CRCs collided are told apart ---------------
#: two module paths whose variant notes had equal 31-bit CRCs ("mode=agkv chunks=1 key_mask=None tag=<path>")
_COLLIDED = ("single_transformer_blocks.707.attn", "layers.8903.attention")


def test_variant_tags_of_collided_paths_differ():
    from cp_ops import contract

    a, b = (contract.variant_tag(mode="agkv", chunks=1, key_mask="None", tag=t) for t in _COLLIDED)
    assert a != b
    assert contract._digest(repr(_COLLIDED[0])) != contract._digest(repr(_COLLIDED[1]))


def _collided_tags(rank, w):
    (q, k, v), _ = _shards(rank, w, 8, 0)
    with pytest.raises(ValueError, match=r"differ in variant.*rank 0: .*tag=single_transformer_blocks\.707\.attn.*"
                                         r"rank 1: .*tag=layers\.8903\.attention"):
        cp_ops.attention(q, k, v, mode="agkv", chunks=1, transport="torch", tag=_COLLIDED[rank])


def test_ranks_at_two_layers_whose_crcs_collided_raise():
    run_ranks(_collided_tags, 2)
