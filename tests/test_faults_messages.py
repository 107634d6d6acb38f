"""Messages a new user meets on bad input: each says what to do in the user's terms."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cp_ops


def test_an_fp64_input_is_told_fp32_or_bf16():
    from cp_ops import validate

    with pytest.raises(ValueError, match=r"q must be float32, float16 or bfloat16 .*got torch\.float64: convert it "
                                         r"with \.to\(torch\.float32\) or \.to\(torch\.bfloat16\)"):
        validate.check_dtype("q", torch.randn(1, 4, 2, 8, dtype=torch.float64))


def test_an_int_key_mask_is_told_to_pass_a_bool_mask():
    from cp_ops import layout

    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"pass a bool mask \(for a 0/1 mask: mask > 0\); got dtype torch\.int64") as e:
        layout.check_key_mask(torch.ones(1, 4, dtype=torch.int64), x)
    assert "additive" not in str(e.value)  # an int mask is not an additive one
    with pytest.raises(ValueError, match=r"pass a bool mask .*additive float masks are not supported; got dtype "
                                         r"torch\.float32"):
        layout.check_key_mask(torch.zeros(1, 4), x)


def test_an_int_attention_mask_in_a_parallelized_model_is_told_to_pass_a_bool_mask():
    pytest.importorskip("diffusers")
    from cp_ops.integrations.diffusers.dispatch import CPAttention

    attn = CPAttention(state=None, streams=("image",), where="blocks.0.attn1")
    q = torch.randn(2, 5, 2, 8)
    with pytest.raises(ValueError, match=r"blocks\.0\.attn1\): the attention mask must be a bool key-padding mask "
                                         r"\(True = attend\): pass a bool mask .*got dtype torch\.int64"):
        attn.key_mask(torch.ones(2, 1, 1, 5, dtype=torch.int64), q)


def test_describe_without_a_process_group_says_how_to_describe_for_w_ranks():
    assert not dist.is_initialized()
    q = torch.randn(1, 64, 8, 16)
    with pytest.raises(RuntimeError, match=r"(?s)needs an initialized torch\.distributed process group.*\n.*"
                                           r"cp_ops\.describe.*init_process_group\('fake', store=FakeStore\(\)") as e:
        cp_ops.describe(q)
    # the advice works as written
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401 - the message's import

    exec(str(e.value).split("describe on a 'fake' group of W ranks (nothing runs): ")[1].replace("W)", "4)"),
         {"torch": torch})
    try:
        assert cp_ops.describe(q).mode == "ulysses"  # W=4 divides H=8
    finally:
        dist.destroy_process_group()



def test_the_pass_says_a_warm_cache_runs_without_it(caplog):
    """TORCH_LOGS=+cp_ops with a warm Inductor cache printed nothing: the pass's cache key (asked on every compile, hit
    or miss) says, once, that a cached graph comes back without the pass running."""
    import logging

    import cp_ops.passes as cp_passes

    cp_passes._said_cached = False
    with caplog.at_level(logging.DEBUG, logger="cp_ops.passes"):
        cp_passes.OverlapPass().uuid()
        cp_passes.OverlapPass().uuid()
    said = [r.getMessage() for r in caplog.records if "cache" in r.getMessage()]
    assert len(said) == 1 and "the pass does not run again" in said[0], said
