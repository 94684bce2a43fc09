"""The error bounds that tests compare backends and paths with, computed from docs/native.md.

Every native GEMM and the emulation compute the exact ``sum_k a_k b_k`` of the decoded operands
up to float32 accumulation (docs/native.md, "Against the emulation"): per entry, with
``u = 2^-24``,

    |out - exact| <= (K + r) * u * sum_k |a_k b_k|

where ``r`` counts the roundings besides the K-term sum (4 for the FP8 GEMM's scale factors).
Two such results (two backends, a sharded and an unsharded call, a batched and a single one)
differ by at most twice that; then each is rounded to its output type (half an ulp of the output,
``eps_out * |exact|`` relative plus half the output's subnormal spacing).

Example:
    >>> import numpy as np
    >>> float(accumulation(np.float64(1.0), k=12))
    9.5367431640625e-07
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

U = 2.0**-24  # float32's unit roundoff
EPS_OUT = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}  # half an output ulp
TINY_OUT = {"float32": 2.0**-150, "bfloat16": 2.0**-134, "float16": 2.0**-25}  # half a subnormal


def accumulation(abs_sum, k: int, roundings: int = 4):
    """One result against the exact sum: ``(K + roundings) * u * sum_k |a_k b_k|``."""
    return (k + roundings) * U * np.asarray(abs_sum, np.float64)


def against_exact(abs_sum, k: int, exact, out_dtype=jnp.float32, roundings: int = 4):
    """One result, rounded to ``out_dtype``, against the exact sum ``exact``: the accumulation
    bound plus half an output ulp."""
    name = np.dtype(out_dtype).name
    exact = np.abs(np.asarray(exact, np.float64))
    return accumulation(abs_sum, k, roundings) + EPS_OUT[name] * exact + TINY_OUT[name]


def between(abs_sum, k: int, want, out_dtype=jnp.float32, roundings: int = 4):
    """Two results of the same GEMM (two backends or two paths) against each other: twice
    :func:`against_exact` around ``want``."""
    return 2 * against_exact(abs_sum, k, want, out_dtype, roundings)


def abs_products(a, b):
    """``sum_k |a_k b_k|`` of decoded operands ``[..., M, K]`` and ``[..., N, K]`` (float64)."""
    a, b = (np.abs(np.asarray(v, np.float64)) for v in (a, b))
    return np.einsum("...mk,...nk->...mn", a, b)


def assert_within(got, want, bound, what: str = "") -> None:
    """``|got - want| <= bound`` everywhere (NaN where ``want`` is NaN); the failure names the
    worst entry as a fraction of its bound."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = np.broadcast_to(np.asarray(bound, np.float64), want.shape)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), f"{what}: NaN where the other has none"
    err = np.where(nan, 0.0, np.abs(got - want))
    bad = ~(err <= bound)
    if bad.any():
        frac = float(np.max(err[bad] / np.maximum(bound[bad], 1e-300)))
        raise AssertionError(f"{what}: {bad.sum()} entries off, worst {frac:.3g} of the bound")
