"""The GEMM of ``backend="xla"``: jaxmx's codes and scales through ``jax.lax.scaled_dot``.

``lax.scaled_dot`` lowers to the StableHLO composite ``xla.scaled_dot``, which XLA may lower to
a native block-scaled GEMM and otherwise decomposes (on the CPU always): each operand and its
scales (repeated over their subchannel along K) are converted to bfloat16 and multiplied, then a
``dot_general`` accumulates in float32. The operands go in as jaxmx stores them (E4M3 / E5M2 /
E2M1 codes; E8M0 scales in 32-blocks, NVFP4's E4M3 scales in 16-blocks), after two exact
changes that make the decomposition give the emulation's bits (:mod:`~jaxmx._src.gemm.emulate`):

- E8M0 scales are made relative to their row's largest finite scale ``2^s`` (an integer
  subtraction on the scale bytes; NaN scales stay NaN), and the float32 result is multiplied by
  ``2^(s_a + s_b)`` afterwards, as the emulation does: ``code * scale`` then never overflows
  bfloat16 (a scale of ``2^127`` times an element of 448 would), and every product is the
  emulation's. Operands whose scales span more than that frame keeps exactly
  (:func:`~jaxmx._src.gemm.blockwise.fits_row_relative`) take the emulation's exact blockwise
  path instead, so the result is the emulation's there too; a block more than
  ``2^127`` below its row's largest then holds only zeros or sits under a NaN scale, and enters
  as zero codes (NaN scales stay NaN).
- Codes in the padding of a K that is not a multiple of the block are zeroed, whatever they
  hold (the emulation ignores them too).

NVFP4's E4M3 block scales go in unchanged (``code * s`` is exact in bfloat16) and its tensor
scales multiply the float32 result, ``g_a * g_b``, as in the emulation. Float32 block scales
(block FP8) are not taken here: the decomposition would round them to bfloat16. Block FP8 with
power-of-two scales runs as its MXFP8 twin (:func:`~jaxmx._src.quantize.pow2_blocks.as_mx`).

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> from jaxmx._src.gemm.scaled_dot import scaled_dot_matmul
    >>> a = jaxmx.quantize(jnp.ones((2, 64)))
    >>> b = jaxmx.quantize(jnp.full((3, 64), 0.5))
    >>> scaled_dot_matmul(a, b, jnp.float32).tolist()
    [[32.0, 32.0, 32.0], [32.0, 32.0, 32.0]]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import bits, exponents, wire
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.mxarray_layouts import untiled
from jaxmx._src.gemm.emulate import exact_or_row_relative, rescaled, with_tensor_scales
from jaxmx._src.gemm.kernels import Kernel
from jaxmx._src.quantize.pow2_blocks import as_mx
from jaxmx._src.quantize.scales import relative_exponents

MIN_E8M0_EXPONENT = -bits.EXPONENT_BIAS
"""The smallest exponent an E8M0 scale holds (``2^-127``, the byte 0)."""


@functools.partial(jax.jit, static_argnums=2)
def scaled_dot_matmul(a: MXArray, b: MXArray, out_dtype) -> jax.Array:
    """``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` on checked MX or NVFP4 operands in
    1-D blocks ([..., M, K] or [..., K, M], and likewise ``b``), through ``lax.scaled_dot``."""
    out = exact_or_row_relative(a, b, _scaled_dot)
    return with_tensor_scales(out, a, b).astype(out_dtype)


def _scaled_dot(a: MXArray, b: MXArray) -> jax.Array:
    """The float32 product through ``lax.scaled_dot`` on row-relative scales, rescaled."""
    a_codes, a_scale, a_shift = _operand(a)
    b_codes, b_scale, b_shift = _operand(b)
    batch = tuple(range(a.data.ndim - 2))
    dims = (((a.data_axis,), (b.data_axis,)), (batch, batch))
    if a.data.shape[a.data_axis] == 0:  # empty K: zeros (lax.scaled_dot divides by K blocks)
        out = lax.dot_general(a_codes, b_codes, dims, preferred_element_type=jnp.float32)
    else:
        out = lax.scaled_dot(
            a_codes,
            b_codes,
            lhs_scale=a_scale,
            rhs_scale=b_scale,
            dimension_numbers=dims,
            preferred_element_type=jnp.float32,
        )
    return rescaled(out, a_shift, b_shift, a, b)


def _operand(q: MXArray) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(codes, scales, per-row exponent s) of ``q`` for ``lax.scaled_dot``: E8M0 scales relative
    to their rows (``s``: each row's largest exponent), others as they are (``s = 0``)."""
    k = q.data_axis
    if not q.format.scale_kind.pow2:
        rows = q.scale.shape[:k] + q.scale.shape[k + 1 :]
        return _zeroed(q, None), q.scale, jnp.zeros(rows, jnp.int32)
    relative, row_max, nan = relative_exponents(q.scale, k)
    underflow = relative < MIN_E8M0_EXPONENT
    byte = jnp.where(
        nan, exponents.E8M0_NAN, jnp.where(underflow, 0, relative + bits.EXPONENT_BIAS)
    )
    scale = wire.from_bytes(byte.astype(jnp.uint8), jnp.float8_e8m0fnu)
    return _zeroed(q, underflow & ~nan), scale, row_max


def _zeroed(q: MXArray, blocks: jax.Array | None) -> jax.Array:
    """``q``'s codes with the padding along K zeroed, and every block where ``blocks`` (shaped
    like the scales, or None) is true."""
    f, k, data = q.format, q.data_axis, q.data
    padded = q.shape[q.axis] != data.shape[k]
    if blocks is None and not padded:
        return data
    n_blocks = q.scale.shape[k]
    blocked = (*data.shape[:k], n_blocks, f.block, *data.shape[k + 1 :])
    zero = jnp.zeros(blocked, bool)
    if blocks is not None:
        zero = zero | jnp.expand_dims(blocks, k + 1)
    if padded:
        index = lax.broadcasted_iota(jnp.int32, blocked, k) * f.block + lax.broadcasted_iota(
            jnp.int32, blocked, k + 1
        )
        zero = zero | (index >= q.shape[q.axis])
    codes = jnp.where(zero, jnp.zeros((), data.dtype), data.reshape(blocked))
    return codes.reshape(data.shape)


XLA = Kernel(
    name="xla",
    run=lambda a, b, out_dtype, _: scaled_dot_matmul(untiled(a), untiled(b), out_dtype),
)
"""``backend="xla"``: MX and NVFP4 operands as stored through ``jax.lax.scaled_dot``."""

XLA_POW2_TWIN = Kernel(
    name="xla_pow2_twin",
    run=lambda a, b, out_dtype, _: scaled_dot_matmul(as_mx(a), as_mx(b), out_dtype),
)
"""Block FP8 with power-of-two scales as its MX twin, through :data:`XLA`'s GEMM."""
