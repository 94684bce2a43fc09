"""The exact MX GEMM for operands whose block scales span more than the row-relative decode keeps.

The fast emulation (:mod:`~jaxmx._src.gemm.emulate`) and ``backend="xla"``
(:mod:`~jaxmx._src.gemm.scaled_dot`) decode each row relative to its largest block scale
``2^s`` and multiply the float32 product by ``2^(s_a + s_b)``. Every product of a block ``2^d_a``
below its row's largest with one ``2^d_b`` below the other row's largest is then formed as
``code_a * code_b * 2^-(d_a + d_b)``: exact, and no partial sum is a float32 subnormal (which
XLA:CPU flushes), as long as ``d_a + d_b <= 126 + q_a + q_b`` (``2^q``: the element format's
smallest step, e.g. ``2^-9`` for E4M3, so the bound is 108 for E4M3 x E4M3). Beyond it a
product can be lost, and it need not be negligible: when the scales compensate across the
operands (an ``lhs`` row with blocks at ``2^73`` and ``2^-67`` against an ``rhs`` row at
``2^-67`` and ``2^73``) every product sits ``2^140`` below ``2^(s_a + s_b)``.

:func:`fits_row_relative` decides it from the scales and one nonzero test per block (only
blocks holding a nonzero element count, so an all-zero block at ``2^-127`` does not), and
:func:`blockwise_matmul` is the exact path taken otherwise: one float32 dot per block of K
(``sum`` over 32 elements of ``code_a * code_b``, exact products), each multiplied by
``2^(e_a + e_b)`` on the float32 bits with one rounding (overflow to ``inf``), summed in
float32 over the blocks. Terms below ``2^-60`` are summed apart, scaled by ``2^100``, and added
back with one rounding at the end, so that a result in float32's subnormal range is kept (XLA:CPU
flushes subnormal sums): with one block of K, or terms that are all that small, it is the
float32 sum rounded once.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> from jaxmx._src.gemm.blockwise import blockwise_matmul, fits_row_relative
    >>> codes = jnp.ones((1, 64), jnp.float8_e4m3fn)
    >>> big_small = jnp.array([[200, 60]], jnp.uint8).view(jnp.float8_e8m0fnu)  # 2^73, 2^-67
    >>> a = jaxmx.MXArray(codes, big_small, "mxfp8_e4m3", 1, (1, 64))
    >>> b = jaxmx.MXArray(codes, big_small[:, ::-1], "mxfp8_e4m3", 1, (1, 64))
    >>> bool(fits_row_relative(a, b)), blockwise_matmul(a, b).tolist()   # 64 * 2^6
    (False, [[4096.0]])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import bits
from jaxmx._src.core.grid_array import GridArray
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.quantize.fake import element_values
from jaxmx._src.quantize.scales import relative_exponents, rule_of


def row_relative_limit(a: MXArray | GridArray, b: MXArray | GridArray) -> int:
    """The largest ``d_a + d_b`` (binades below the rows' largest blocks) whose products the
    row-relative decode forms exactly: ``126 + q_a + q_b`` for element steps ``2^q``."""
    return 126 + sum(q.format.emin - q.format.mbits for q in (a, b))


def row_depth(q: MXArray | GridArray) -> jax.Array:
    """int32 scalar: how many binades the deepest block holding a nonzero element (with a
    finite scale) lies below its row's largest block scale, over all rows; 0 for scales that
    are not E8M0 (their products need no row-relative decode)."""
    if not q.format.scale_kind.pow2:
        return jnp.int32(0)
    relative, _, nan = relative_exponents(q.scale, q.data_axis)
    nonzero = jnp.any(_blocked(q, element_values(q)) != 0, axis=q.data_axis + 1)
    return jnp.max(bits.where(nonzero & ~nan, -relative, 0), initial=0)


def fits_row_relative(a: MXArray | GridArray, b: MXArray | GridArray) -> jax.Array:
    """bool scalar: whether every product the row-relative decode forms is exact
    (:func:`row_depth` of both operands within :func:`row_relative_limit`)."""
    return row_depth(a) + row_depth(b) <= row_relative_limit(a, b)


def needs_check(a: MXArray | GridArray, b: MXArray | GridArray) -> bool:
    """Whether the operands can exceed :func:`row_relative_limit` at all (static): an E8M0
    operand and a K of at least one block."""
    pow2 = a.format.scale_kind.pow2 or b.format.scale_kind.pow2
    return pow2 and a.scale.shape[a.data_axis] > 0


_SMALL_SHIFT = 100
_SMALL_BELOW = 60


@jax.jit
def blockwise_matmul(a: MXArray | GridArray, b: MXArray | GridArray) -> jax.Array:
    """float32 ``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` (NVFP4's tensor scales
    left out) from one dot per block of K, each rescaled exactly: see the module docstring.
    Operands as for :func:`~jaxmx._src.gemm.emulate.emulated_matmul`, with at least one block
    of K."""
    a_values, a_exponent = _tn_blocks(a)
    b_values, b_exponent = _tn_blocks(b)
    batch = tuple(range(a_values.ndim - 3))

    def terms(a_block, b_block, a_e, b_e):  # [..., M, block], [..., N, block], [..., M], [..., N]
        block_dims = (((a_block.ndim - 1,), (b_block.ndim - 1,)), (batch, batch))
        out = lax.dot_general(a_block, b_block, block_dims, preferred_element_type=jnp.float32)
        shift = a_e[..., :, None] + b_e[..., None, :]
        # out is 0, non-finite or a normal float32 (a sum of multiples of 2^-32): its exponent
        exponent = ((bits.to_bits(out) >> bits.MANTISSA_BITS) & 0xFF) - bits.EXPONENT_BIAS
        tiny = exponent + shift < -_SMALL_BELOW
        term = bits.ldexp_rounded(out, shift + bits.where(tiny, _SMALL_SHIFT, 0))
        return bits.where(tiny, 0.0, term), bits.where(tiny, term, 0.0)

    def step(sums, blocks):
        big, small = terms(*blocks)
        return (sums[0] + big, sums[1] + small), None

    a_steps = jnp.moveaxis(a_values, -2, 0)
    b_steps = jnp.moveaxis(b_values, -2, 0)
    a_e_steps = jnp.moveaxis(a_exponent, -1, 0)
    b_e_steps = jnp.moveaxis(b_exponent, -1, 0)
    first = terms(a_steps[0], b_steps[0], a_e_steps[0], b_e_steps[0])
    rest = (a_steps[1:], b_steps[1:], a_e_steps[1:], b_e_steps[1:])
    (big, small), _ = lax.scan(step, first, rest)
    small = bits.ldexp_rounded(small, -_SMALL_SHIFT)
    return bits.where(big == 0, small, big + small)


def _blocked(q, values: jax.Array) -> jax.Array:
    """``values`` (shaped like ``q.data``) as blocks: [..., KB, block, ...] at ``q.data_axis``."""
    f, k, data = q.format, q.data_axis, q.data
    return values.reshape(*data.shape[:k], q.scale.shape[k], f.block, *data.shape[k + 1 :])


def _tn_blocks(q) -> tuple[jax.Array, jax.Array]:
    """(unscaled values [..., rows, KB, block] bfloat16, block exponents [..., rows, KB] int32)
    of ``q``: E8M0 operands as element values (NaN under a NaN scale) and their scales' exponents;
    NVFP4 as ``code * s`` and exponent 0. Padding codes along K are zeroed."""
    f, k = q.format, q.data_axis
    values = _blocked(q, element_values(q))
    if f.scale_kind.pow2:
        relative, row_max, nan = relative_exponents(q.scale, k)
        exponent = bits.where(nan, 0, relative + jnp.expand_dims(row_max, k))
        values = bits.where(jnp.expand_dims(nan, k + 1), jnp.nan, values)
    else:
        values, _ = rule_of(f).relative_to_rows(values, q.scale, k)
        exponent = jnp.zeros(q.scale.shape, jnp.int32)
    if q.shape[q.axis] != q.data.shape[k]:
        shape = values.shape
        index = lax.broadcasted_iota(jnp.int32, shape, k) * f.block + lax.broadcasted_iota(
            jnp.int32, shape, k + 1
        )
        values = bits.where(index < q.shape[q.axis], values, 0)
    if k == q.data.ndim - 2:  # [..., KB, block, rows] -> [..., rows, KB, block]
        values = jnp.moveaxis(values, -1, -3)
        exponent = jnp.swapaxes(exponent, -1, -2)
    return values.astype(jnp.bfloat16), exponent
