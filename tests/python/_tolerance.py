"""docs/testing.md's tolerance rule, in one place for every op's tests.

bf16 / fp16: max|fused - oracle64| <= 2 * max|naive_same_dtype - oracle64| + ABSOLUTE
(FlashAttention's rule: at most twice as far from the exact answer as plain PyTorch).
fp32: max|fused - oracle64| <= 1e-4 * max|oracle64| + ABSOLUTE.

The same absolute term in both: a result that is exactly zero (a query that sees one
key has a zero gradient, a KL of one visible key is zero) comes out of cancelling
fp32 terms of size one to ten, a few of their roundings (about 1e-7 each) off; a
relative bound on zero asks for exactness no fp32 summation order gives."""
from __future__ import annotations

ABSOLUTE = 1e-5
RELATIVE_FP32 = 1e-4


def bound(fp32: bool, oracle_scale: float, naive_err: float | None) -> float:
    """The largest error allowed: oracle_scale = max|oracle| (fp32), naive_err =
    max|naive_same_dtype - oracle| (bf16 / fp16)."""
    if fp32:
        return RELATIVE_FP32 * oracle_scale + ABSOLUTE
    return 2 * naive_err + ABSOLUTE
