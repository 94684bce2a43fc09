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
:func:`exact_into` (:func:`blockwise_matmul` on its own) is the exact path taken otherwise:
one float32 dot per block of K (``sum`` over 32 elements of ``code_a * code_b``, exact
products), each scaled by ``2^(e_a + e_b)`` relative to a frame that follows the largest
nonzero term so far (the running sum is moved, exactly, when a later block's exponent is
larger), summed in float32, and rounded once when the frame is applied at the end; a few rows
of ``a`` at a time, each block decoded where the loop reads it. Every partial sum then lies
below ``2^37`` times the number of blocks (no intermediate overflow: a result past float32's
range is ``inf`` of the exact sum's sign), and what a partial sum flushes lies below ``2^-126``
of the frame, at most ``2^-94`` of the largest product's magnitude. With one block of K it
is the float32 dot rounded once.

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

from jaxmx._src.core import bits, exponents
from jaxmx._src.core.grid_array import GridArray
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.vma import vary_like
from jaxmx._src.quantize.codec import decode_elements, scale_exponent_bytes
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
    codes = q.data if jnp.issubdtype(q.data.dtype, jnp.floating) else element_values(q)
    nonzero = jnp.any(_blocked(q, codes) != 0, axis=q.data_axis + 1)  # NaN codes count
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


_NO_TERM = -(2**20)  # the frame exponent of an entry no nonzero block product has reached yet
_NAN_EXPONENT = 2**12  # a NaN scale's exponent: any pair's sum is past 2 * 127


_ROW_CHUNK = 8  # rows of ``a`` the exact path sums at a time (its temporaries: [8, N])


@jax.jit
def blockwise_matmul(a: MXArray | GridArray, b: MXArray | GridArray) -> jax.Array:
    """float32 ``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` (NVFP4's tensor scales
    left out) from one dot per block of K, each rescaled exactly: see the module docstring.
    Operands as for :func:`~jaxmx._src.gemm.emulate.emulated_matmul`, with at least one block
    of K; either may be blocked along its last axis or (K-first) along the one before."""
    shape = (*a.data.shape[: a.data.ndim - 2], _rows(a), _rows(b))
    return exact_into(vary_like(jnp.zeros(shape, jnp.float32), *jax.tree.leaves((a, b))), a, b)


def exact_into(out: jax.Array, a: MXArray | GridArray, b: MXArray | GridArray) -> jax.Array:
    """``out`` (float32 [..., M, N]) overwritten, :data:`_ROW_CHUNK` rows at a time, with
    :func:`blockwise_matmul`'s result: the exact path's temporaries are those of a few rows, and
    it writes in place into a result it is given (the fast path's, which it replaces)."""
    m = _rows(a)
    if m == 0 or _rows(b) == 0:
        return out
    size = min(m, _ROW_CHUNK)
    a_exponent, b_exponent = _exponents(a), _exponents(b)

    def chunk(j, out):
        start = jnp.minimum(j * size, m - size)  # the last chunk may overlap the one before
        rows = _sum_blocks(a, b, a_exponent, b_exponent, (start, size))
        return lax.dynamic_update_slice_in_dim(out, rows, start, axis=out.ndim - 2)

    return lax.fori_loop(0, -(-m // size), chunk, out)


def _sum_blocks(a, b, a_exponent, b_exponent, rows) -> jax.Array:
    """float32 [..., size, N]: the exact sum over K for the rows ``(start, size)`` of ``a``."""
    a_kb, b_kb = a.data_axis, b.data_axis  # the KB axis of the blocked codes and of the scales
    batch = tuple(range(a.data.ndim - 2))
    # a block (its KB axis of size 1 and its elements) is contracted; the rows stay
    dims = (((a_kb, a_kb + 1), (b_kb, b_kb + 1)), (batch, batch))
    a_exponent = lax.dynamic_slice_in_dim(a_exponent, *rows, _row_axis(a))

    def step(i, carry):  # carry: the sum so far as ``total * 2^frame``
        total, frame = carry
        a_block, b_block = _block(a, i, rows), _block(b, i)
        out = lax.dot_general(a_block, b_block, dims, preferred_element_type=jnp.float32)
        a_e = lax.dynamic_index_in_dim(a_exponent, i, a_kb, keepdims=False)
        b_e = lax.dynamic_index_in_dim(b_exponent, i, b_kb, keepdims=False)
        exponent = a_e[..., :, None] + b_e[..., None, :]
        out = bits.where(exponent > 2 * bits.EXPONENT_BIAS, jnp.nan, out)  # a NaN scale
        new_frame = jnp.maximum(frame, bits.where(out != 0, exponent, _NO_TERM))
        return _down(total, frame - new_frame) + _down(out, exponent - new_frame), new_frame

    shape = (*a.data.shape[: len(batch)], rows[1], _rows(b))
    # -0 + x is x for every x, -0 included: the sum's sign of zero is IEEE's. The carry varies
    # over the shard_map axes the operands vary over (as the loop body's results do).
    start = (jnp.full(shape, -0.0, jnp.float32), jnp.full(shape, _NO_TERM, jnp.int32))
    start = tuple(vary_like(x, *jax.tree.leaves((a, b))) for x in start)
    total, frame = lax.fori_loop(0, a.scale.shape[a_kb], step, start)
    return exponents.ldexp_rounded(total, frame)


def _down(x: jax.Array, shift: jax.Array) -> jax.Array:
    """``x * 2^shift`` for ``shift <= 0`` (larger shifts are taken as 0: only zeros get them),
    as two float32 multiplies by powers of two: exact where the result is normal; below
    ``2^-126`` it may flush (XLA:CPU), and below ``2^-252`` it does."""
    first = jnp.clip(shift, -126, 0)
    return x * exponents.pow2(first) * exponents.pow2(jnp.clip(shift - first, -126, 0))


def _blocked(q, values: jax.Array) -> jax.Array:
    """``values`` (shaped like ``q.data``) as blocks: [..., KB, block, ...] at ``q.data_axis``."""
    f, k, data = q.format, q.data_axis, q.data
    return values.reshape(*data.shape[:k], q.scale.shape[k], f.block, *data.shape[k + 1 :])


def _rows(q) -> int:
    """The number of rows (M or N) of a GEMM operand."""
    return q.data.shape[-1] if q.data_axis == q.data.ndim - 2 else q.data.shape[-2]


def _exponents(q) -> jax.Array:
    """int32 block exponents shaped like ``q.scale``: an E8M0 scale's, :data:`_NAN_EXPONENT`
    for a NaN scale; 0 for other scales (NVFP4's enter the block values)."""
    if not q.format.scale_kind.pow2:
        return jnp.zeros(q.scale.shape, jnp.int32)
    byte = scale_exponent_bytes(q.scale)
    return bits.where(byte == exponents.E8M0_NAN, _NAN_EXPONENT, byte - bits.EXPONENT_BIAS)


def _row_axis(q) -> int:
    """The rows' axis of ``q``'s scales (and exponents); in its blocked codes, one more for a
    K-first operand (whose rows follow the block's elements)."""
    return q.data.ndim - 1 if q.data_axis == q.data.ndim - 2 else q.data.ndim - 2


def _block(q, i, rows=None) -> jax.Array:
    """Block ``i`` of K of ``q`` (of the rows ``(start, size)`` if given) as bfloat16 values,
    its KB axis kept (size 1): E8M0 operands' element values, NVFP4's ``code * s``; codes in the
    padding of K zeroed."""
    f, k = q.format, q.data_axis
    codes = lax.dynamic_index_in_dim(_blocked(q, q.data), i, k, keepdims=True)
    k_first = k == q.data.ndim - 2
    if rows is not None:
        codes = lax.dynamic_slice_in_dim(codes, *rows, _row_axis(q) + k_first)
    values = codes if isinstance(q, GridArray) else decode_elements(codes, f)
    if not f.scale_kind.pow2:
        scale = lax.dynamic_index_in_dim(q.scale, i, k, keepdims=True)
        if rows is not None:
            scale = lax.dynamic_slice_in_dim(scale, *rows, _row_axis(q))
        values, _ = rule_of(f).relative_to_rows(values, scale, k)
    if q.shape[q.axis] != q.data.shape[k]:
        index = i * f.block + lax.broadcasted_iota(jnp.int32, values.shape, k + 1)
        values = bits.where(index < q.shape[q.axis], values, 0)
    return values.astype(jnp.bfloat16)
