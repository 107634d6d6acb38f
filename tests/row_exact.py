"""Whether this machine's CPU matmul gives a token's row the same bits in a shard as in the whole sequence.

The model tests compare a parallelized model with the unparallelized one bitwise where CP attention sees the keys in
one device's order: every other layer then computes each token's row from the same data, but on S/W rows instead of
S. That is exact only where the BLAS rounds a row independently of how many rows it is given. Not everywhere: on an
AVX512 Xeon with torch 2.13's MKL (2024.2), ``x @ w`` of a [1, 4, 4, 8] shard of a [1, 16, 4, 8] tensor (16 rows
of 8 against 64) differs from the whole product's rows in the last bit, and the tiny Wan, LTX-Video, Helios and
ChronoEdit models by ≤ 5e-7 (found 2026-12-02, where every earlier CI machine had been exact). There the tests
compare to rounding (:data:`REL`) instead, and say so in their message.
"""

import functools

import torch

#: the relative error allowed where this machine's matmul is not row-exact (float32: a few ulps of the largest value)
REL = 2e-6


@functools.cache
def shard_rows_exact() -> bool:
    """True when ``x[:, shard] @ w == (x @ w)[:, shard]`` bitwise for a few small shapes (the tests' sizes: 4-16
    rows, 8-96 features) at the current thread count; cached per process."""
    g = torch.Generator().manual_seed(0)
    for b, s, h, k, n in ((1, 16, 4, 8, 8), (2, 16, 1, 32, 96), (1, 8, 1, 16, 48)):
        x, w = torch.randn(b, s, h, k, generator=g), torch.randn(k, n, generator=g)
        whole = x @ w
        for i in range(4):
            rows = slice(i * s // 4, (i + 1) * s // 4)
            if not torch.equal(x[:, rows] @ w, whole[:, rows]):
                return False
    return True


def assert_same(out: torch.Tensor, ref: torch.Tensor, what) -> None:
    """``out`` equals ``ref`` bitwise where this machine's matmul is row-exact (:func:`shard_rows_exact`), else within
    :data:`REL` of ``ref``'s largest value."""
    if shard_rows_exact():
        assert torch.equal(out, ref), (what, "not bitwise", (out - ref).abs().max().item())
    else:
        rel = ((out - ref).abs().max() / ref.abs().max()).item()
        assert rel <= REL, (what, f"relative error {rel:.3g} > {REL} (this CPU's matmul is not row-exact: "
                                  "tests/row_exact.py)")
