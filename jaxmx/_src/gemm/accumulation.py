"""The emulated MX GEMM with a limited-precision accumulator: a model of Hopper's FP8 tensor cores.

DeepSeek-V3's report (section 3.5.2) describes the accumulation of FP8 GEMMs on Hopper: the
products of a 32-element step are aligned to the largest exponent among them and the running
sum, and only the top ~14 bits of each survive. :class:`Accumulation` is that model; DeepSeek-V3
counters it by promoting the partial sum to float32 every 128 elements of K (``promote_every``).

In steps of 32 elements of K, for each output element: the running sum ``s`` and the step's 32
products ``p_i`` (each exact in float32) are written ``m * 2^q`` with ``q = e - bits`` for
``2^(e-1) <= max(|s|, |p_i|) < 2^e``, truncated toward zero to whole multiples of ``2^q`` and
added (exactly: at most 33 terms of at most ``2^bits`` quanta each). Every ``promote_every``
elements, and at the end of K, the running sum is added to a float32 total and restarted.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> a = jaxmx.quantize(jnp.ones((1, 64)).at[0, 32].set(2.0**-20))
    >>> b = jaxmx.quantize(jnp.ones((1, 64)))
    >>> acc = Accumulation(bits=14)
    >>> float(limited_matmul(a, b, jnp.float32, acc)[0, 0])   # 2^-20 falls below 14 bits of 32
    63.0
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import exponents
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.mxarray_layouts import untiled
from jaxmx._src.core.recipes import STEP, Accumulation
from jaxmx._src.core.sizes import round_up
from jaxmx._src.gemm.emulate import decode_rows
from jaxmx._src.gemm.kernels import Kernel


@functools.partial(jax.jit, static_argnums=(2, 3))
def limited_matmul(a: MXArray, b: MXArray, out_dtype, accumulation: Accumulation) -> jax.Array:
    """``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` with the accumulator of
    ``accumulation`` (operands as for :func:`jaxmx.matmul`, already checked).

    Costs one elementwise pass over all ``M * N * K`` products (it materialises ``M * N * 32``
    float32 values per step): a model for studying accuracy, not a fast path.
    """
    a_values, a_shift = _tn_rows(a)
    b_values, b_shift = _tn_rows(b)
    k = a_values.shape[-1]
    padded = round_up(k, STEP)
    steps_per_promotion = (accumulation.promote_every or padded) // STEP

    def by_step(values):  # [..., R, K] -> [steps, ..., R, 32]
        values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, padded - k)])
        return jnp.moveaxis(values.reshape(*values.shape[:-1], padded // STEP, STEP), -2, 0)

    def step(carry, inputs):
        total, partial = carry
        index, a_step, b_step = inputs
        products = a_step[..., :, None, :] * b_step[..., None, :, :]  # [..., M, N, 32], exact
        partial = _truncated_sum(
            jnp.concatenate([partial[..., None], products], -1), accumulation.bits
        )
        promote = ((index + 1) % steps_per_promotion == 0) | (index + 1 == padded // STEP)
        total = jnp.where(promote, total + partial, total)
        return (total, jnp.where(promote, 0.0, partial)), None

    zeros = jnp.zeros((*a_values.shape[:-1], b_values.shape[-2]), jnp.float32)
    indices = jnp.arange(padded // STEP)
    (total, _), _ = lax.scan(step, (zeros, zeros), (indices, by_step(a_values), by_step(b_values)))
    shift = a_shift[..., :, None] + b_shift[..., None, :]
    half = shift // 2
    return (total * exponents.pow2(half) * exponents.pow2(shift - half)).astype(out_dtype)


def _tn_rows(q: MXArray) -> tuple[jax.Array, jax.Array]:
    """``q`` decoded relative to each row's largest scale (float32), as [..., rows, K]."""
    values, shift = decode_rows(q, jnp.float32)
    if q.data_axis != values.ndim - 1:
        values = jnp.swapaxes(values, -1, -2)
    return values, shift


def _truncated_sum(values: jax.Array, kept_bits: int) -> jax.Array:
    """The sum over the last axis of ``values``, each truncated toward zero to ``kept_bits``
    bits below the largest magnitude's exponent."""
    _, exponent = jnp.frexp(jnp.max(jnp.abs(values), axis=-1, keepdims=True))
    shift = kept_bits - exponent  # values * 2^shift: quanta, exactly
    return jnp.sum(jnp.ldexp(jnp.trunc(jnp.ldexp(values, shift)), -shift), axis=-1)


LIMITED = Kernel(
    name="limited",
    run=lambda a, b, out_dtype, acc: limited_matmul(untiled(a), untiled(b), out_dtype, acc),
)
"""The modelled limited-precision accumulator (``Recipe.accum_bits``), on every platform."""
