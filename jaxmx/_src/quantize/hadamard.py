"""The random Hadamard transform (RHT): a block-diagonal orthonormal rotation that spreads an
outlier over its block before quantization.

Along ``axis``, each block of ``size`` consecutive elements ``v`` becomes ``H @ (d * v) /
sqrt(size)``: ``d`` is a vector of random signs (``jax.random.rademacher(key, (size,))``, the
same for every block) and ``H`` the Sylvester Hadamard matrix (``H_1 = [1]``, ``H_2n = [[H_n,
H_n], [H_n, -H_n]]``). The matrix ``R = H diag(d) / sqrt(size)`` is orthonormal, so applying
the same ``R`` to both operands of a GEMM along its reduction axis leaves the product
unchanged: ``(R a)^T (R b) = a^T b``. NVIDIA's NVFP4 recipe (arXiv 2509.25149) applies a 16x16
RHT to the weight-gradient GEMM's inputs.

The product with ``H`` is computed by ``log2(size)`` add/subtract butterflies in float32, the
same arithmetic on every backend.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> x = jnp.zeros(16).at[3].set(8.0)                     # one outlier
    >>> y = jaxmx.rht(x, 0, jax.random.key(0))
    >>> jnp.abs(y).tolist() == [2.0] * 16                    # spread over the block
    True
    >>> bool(jnp.allclose(jaxmx.rht(y, 0, jax.random.key(0), inverse=True), x))
    True
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxmx._src.core import bits
from jaxmx._src.core.blocks import blocked, padded_shape
from jaxmx._src.core.checks import check_key, normalize_axis
from jaxmx._src.core.dtypes import as_float_array


def rht(
    x: jax.Array, axis: int, key: jax.Array, size: int = 16, *, inverse: bool = False
) -> jax.Array:
    """The random Hadamard transform of ``x`` along ``axis``, in blocks of ``size``.

    Args:
        x: a float32, bfloat16 or float16 array.
        axis: the transformed axis; zero-padded to a multiple of ``size`` (the result keeps the
            padded length: the transform mixes the padding into the block).
        key: a PRNG key; the random signs are ``jax.random.rademacher(key, (size,))``.
        size: the block size, a power of two (16 by default).
        inverse: apply the inverse (the transpose, ``diag(d) H / sqrt(size)``), so that
            ``rht(rht(x, a, k), a, k, inverse=True)`` returns ``x`` (padded) to float32
            rounding.

    Returns:
        The transformed array in float32 (the shape of ``x`` with ``axis`` padded).

    Example:
        >>> import jax, jax.numpy as jnp, jaxmx
        >>> a, b = jnp.ones((20, 3)), jnp.arange(40.0).reshape(20, 2)
        >>> k = jax.random.key(1)
        >>> ra, rb = jaxmx.rht(a, 0, k), jaxmx.rht(b, 0, k)
        >>> ra.shape, bool(jnp.allclose(ra.T @ rb, a.T @ b))
        ((32, 3), True)
    """
    x = bits.upcast_exact(as_float_array(x, "rht: x"))
    if x.ndim == 0:
        raise ValueError("rht expects an array of rank >= 1, got a scalar")
    axis = normalize_axis(axis, x.ndim)
    if isinstance(size, bool) or not isinstance(size, int) or size < 2 or size & (size - 1):
        raise ValueError(f"rht: size must be a power of two >= 2, got {size!r}")
    return _rht(x, check_key(key, "rht"), axis=axis, size=size, inverse=inverse)


@functools.partial(jax.jit, static_argnames=("axis", "size", "inverse"))
def _rht(x: jax.Array, key: jax.Array, *, axis: int, size: int, inverse: bool) -> jax.Array:
    """:func:`rht` of checked arguments: one compiled program per shape and setting."""
    signs = random_signs(key, size)
    blocks = blocked(x, axis, size)  # [outer, n_blocks, size, inner], zero-padded
    signs = signs[:, None]
    if not inverse:
        blocks = blocks * signs
    blocks = _hadamard(blocks) * (1.0 / math.sqrt(size))
    if inverse:
        blocks = blocks * signs
    return blocks.reshape(padded_shape(x.shape, axis, size))


def random_signs(key: jax.Array, size: int) -> jax.Array:
    """The transform's sign vector: ``size`` float32 values of ±1 drawn from ``key``."""
    return jax.random.rademacher(key, (size,), jnp.float32)


def _hadamard(blocks: jax.Array) -> jax.Array:
    """``H @ v`` for every ``v = blocks[o, b, :, i]`` (Sylvester order), by butterflies."""
    outer, nb, size, inner = blocks.shape
    h = 1
    while h < size:
        pairs = blocks.reshape(outer, nb, size // (2 * h), 2, h, inner)
        low, high = pairs[:, :, :, 0], pairs[:, :, :, 1]
        blocks = jnp.stack([low + high, low - high], axis=3).reshape(blocks.shape)
        h *= 2
    return blocks
