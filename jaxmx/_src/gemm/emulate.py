"""The emulated MX GEMM: decode both operands, then ``lax.dot_general`` with float32 accumulation.

Every product of two MX elements (E4M3 / E5M2 / E2M1 code times a power of two) is exact in
float32, so the emulation is the MX definition up to the order of the float32 summation. To keep
that true across the whole E8M0 range (``2^-127 .. 2^127``, beyond what float32 can hold once
multiplied by an element), each row of each operand is decoded relative to its own largest scale
``2^s`` (its values are then at most ``elem_max``) and the result is multiplied by
``2^(s_a + s_b)`` at the end: exact powers of two, so results are unchanged wherever the plain
decode was representable, and finite wherever the exact result is (e.g. a block at ``2^128``
times one at ``2^-100``). The shift is applied to the float32 bits with one rounding to nearest
even, so a result in float32's subnormal range is kept (XLA:CPU would flush the float product)
and equals the native GEMM's bit for bit where the float32 dot is exact (e.g. one block of K).
Where a row's blocks lie so far below its largest that, together with the other operand's,
a product could leave float32's normal range in that frame (the scales compensating across
the operands, say), ``exact=True`` (``jaxmx.matmul``) replaces the result with
:mod:`~jaxmx._src.gemm.blockwise`'s, chosen on the scales: exact (up to float32 summation) for
every pair of E8M0 scale rows; the training GEMMs keep the frame only, unless the recipe
asks for the exact path (``Recipe.exact_emulation``).
Codes in the padding of a K that is not a multiple of the block are ignored, whatever they
hold.

NVFP4 operands (:mod:`jaxmx._src.quantize.nvfp4`) enter the dot as ``code * s`` (exact: at most 6
significant bits, between 2^-10 and 2688) and the float32 result is multiplied by
``alpha = g_a * g_b``, their tensor scales' float32 product, as cuBLASLt applies alpha.

Operands enter the dot as bfloat16, exactly: an element times a power of two has at most 7
significant bits (4 for E4M3 times an E8M0 scale, 6 for an NVFP4 ``code * s``, 7 for an MXINT8
code up to 127) and float32's exponent range, within bfloat16's 8, and bf16 x bf16 products are
exact in float32. It is also the fast form on CPUs
with native bf16 dot products: there XLA:CPU multiplies bfloat16 operands up to 2x faster than
float32 ones (docs/benchmarks.md, "GEMM operands").

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> from jaxmx._src.gemm.emulate import emulated_matmul
    >>> a = jaxmx.quantize(jnp.ones((2, 64)))
    >>> b = jaxmx.quantize(jnp.full((3, 64), 0.5))
    >>> emulated_matmul(a, b, jnp.float32).tolist()
    [[32.0, 32.0, 32.0], [32.0, 32.0, 32.0]]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import bits, exponents
from jaxmx._src.core.grid_array import GridArray
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.mxarray_layouts import untiled
from jaxmx._src.gemm.blockwise import exact_into, fits_row_relative, needs_check
from jaxmx._src.gemm.kernels import Kernel
from jaxmx._src.quantize.fake import element_values
from jaxmx._src.quantize.pow2_blocks import as_mx
from jaxmx._src.quantize.scales import rule_of


@functools.partial(jax.jit, static_argnums=(2, 3))
def emulated_matmul(
    a: MXArray | GridArray, b: MXArray | GridArray, out_dtype, exact: bool = True
) -> jax.Array:
    """``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` on checked MX operands.

    ``a`` is [..., M, K] or [..., K, M] and ``b`` [..., N, K] or [..., K, N], each blocked along
    K; they are contracted in their own layouts (no transposes). Either may be a
    :class:`~jaxmx._src.core.grid_array.GridArray` (element values instead of codes: the same
    result, bit for bit, without decoding codes). Jitted, so eager callers run one compiled
    kernel. ``exact``: take the exact path where the operands' scales span more than the
    row-relative frame keeps (:func:`exact_or_row_relative`); without it, the frame only.
    """
    if exact:
        out = exact_or_row_relative(a, b, _row_relative_matmul)
    else:
        out = _row_relative_matmul(a, b)
    return with_tensor_scales(out, a, b).astype(out_dtype)


def exact_or_row_relative(a, b, row_relative) -> jax.Array:
    """``row_relative(a, b)`` (a float32 GEMM on row-relative operands, before the tensor
    scales), replaced in place by :func:`~jaxmx._src.gemm.blockwise.exact_into` where its
    products are not all exact (:func:`~jaxmx._src.gemm.blockwise.fits_row_relative`): a
    ``lax.while_loop`` of zero or one trip on the operands' scales (under ``vmap``, one trip
    where any mapped GEMM needs it)."""
    out = row_relative(a, b)
    if not needs_check(a, b):
        return out

    def exact(state):
        done, out = state
        return done | True, exact_into(out, a, b)

    return lax.while_loop(lambda state: ~state[0], exact, (fits_row_relative(a, b), out))[1]


def _row_relative_matmul(a, b) -> jax.Array:
    a_values, a_shift = decode_rows(a, jnp.bfloat16)
    b_values, b_shift = decode_rows(b, jnp.bfloat16)
    batch = tuple(range(a.data.ndim - 2))
    out = lax.dot_general(
        a_values,
        b_values,
        (((a.data_axis,), (b.data_axis,)), (batch, batch)),
        preferred_element_type=jnp.float32,
    )
    return rescaled(out, a_shift, b_shift, a, b)


def rescaled(out: jax.Array, a_shift: jax.Array, b_shift: jax.Array, a, b) -> jax.Array:
    """The float32 product ``out`` [..., M, N] of row-relative operands (:func:`decode_rows`)
    times ``2^(s_a + s_b)``: the rows' exponents back, exactly. Only operands with E8M0 scales
    have row exponents (the others' are 0: no constant work is left for XLA to fold)."""
    shift = [
        s for q, s in ((a, a_shift[..., :, None]), (b, b_shift[..., None, :])) if q.format.is_mx
    ]
    if not shift:
        return out
    # in [-254, 254]; one rounding, subnormal results kept (no flushing)
    return exponents.times_pow2(out, functools.reduce(jnp.add, shift))


def with_tensor_scales(out: jax.Array, a, b) -> jax.Array:
    """``out`` times ``g_a * g_b`` (NVFP4's tensor scales, as cuBLASLt applies alpha)."""
    return out * _alpha(a, b, out.ndim)


def _alpha(a, b, ndim: int) -> jax.Array:
    """``g_a * g_b`` (1 for operands without a tensor scale), broadcast against the result."""
    alpha = jnp.float32(1.0)
    for q in (a, b):
        if getattr(q, "global_scale", None) is not None:
            g = q.global_scale
            alpha = alpha * g.reshape(g.shape + (1,) * (ndim - g.ndim))
    return alpha


def decode_rows(q: MXArray | GridArray, dtype) -> tuple[jax.Array, jax.Array]:
    """(values in ``dtype``, per-row exponent s): ``q``'s values are ``values * 2^s``, with each
    row's values decoded relative to its largest (finite) scale, so at most ``elem_max``.
    NVFP4: ``code * s`` per element and s = 0 (the tensor scale is left out)."""
    f = q.format
    data, k = q.data, q.data_axis
    n_blocks = q.scale.shape[k]
    # blocks: [..., rows, KB, block] (K last) or [..., KB, block, rows] (K first)
    blocked = (*data.shape[:k], n_blocks, f.block, *data.shape[k + 1 :])
    values = element_values(q).reshape(blocked)
    scaled, row_exponent = rule_of(f).relative_to_rows(values, q.scale, k)
    scaled = _without_padding(scaled, q, blocked)
    return scaled.reshape(data.shape).astype(dtype), row_exponent


def _without_padding(scaled, q, blocked):
    """``scaled`` (blocked values) with the padding codes along K zeroed, whatever they hold."""
    f, k = q.format, q.data_axis
    if q.shape[q.axis] != q.data.shape[k]:
        index = lax.broadcasted_iota(jnp.int32, blocked, k) * f.block + lax.broadcasted_iota(
            jnp.int32, blocked, k + 1
        )
        scaled = bits.where(index < q.shape[q.axis], scaled, 0)
    return scaled


EMULATE = Kernel(
    name="emulate",
    run=lambda a, b, out_dtype, _: emulated_matmul(untiled(a), untiled(b), out_dtype),
    training=lambda a, b, out_dtype, _: emulated_matmul(
        untiled(a), untiled(b), out_dtype, exact=False
    ),
    gathers_8bit=True,
)
"""Formats whose products ``code * scale`` are exact, in equal blocks, tiles as wide as the
block. The training GEMMs run it in its row-relative frame only (``exact=False``: in every MX
training step the exact path's check and branch would double the compile time and raise the
step's temporaries above bfloat16's, docs/native.md), unless the recipe asks for the exact
path (``Recipe.exact_emulation``: the ``"exact"`` runner)."""


def _one_d(q: MXArray | GridArray) -> MXArray | GridArray:
    """``q`` in 1-D blocks: a tiled MXArray untiled, anything else as it is."""
    return q if isinstance(q, GridArray) else untiled(q)


EMULATE_VALUES = Kernel(
    name="emulate_values",
    run=lambda a, b, out_dtype, _: emulated_matmul(_one_d(a), _one_d(b), out_dtype),
    training=lambda a, b, out_dtype, _: emulated_matmul(
        _one_d(a), _one_d(b), out_dtype, exact=False
    ),
    takes_values=True,
    gathers_8bit=True,
)
""":data:`EMULATE` where the operands that have not been quantized yet are quantized straight to
element values (GridArrays: 1-D blocks of the MX formats and NVFP4), the others being MXArrays
(a residual, a tiled weight): the same bits in less time."""

EMULATE_POW2_TWIN = Kernel(
    name="emulate_pow2_twin",
    run=lambda a, b, out_dtype, _: emulated_matmul(as_mx(a), as_mx(b), out_dtype),
    gathers_8bit=True,
)
"""Block FP8 with power-of-two scales (quantized with ``scale_mode="pow2"``) as its MX twin
through the exact emulation: exact where float32 dequantized operands would overflow (a scale of
``2^127`` times 448) or flush (scales below ``2^-126``)."""
