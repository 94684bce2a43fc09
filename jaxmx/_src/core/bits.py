"""Exact float32 bit arithmetic for powers of two (no log2/exp2, no subnormal flushing).

XLA on CPU flushes float32 subnormals in arithmetic, so every place where a subnormal input or
output matters is built from integer operations on the float32 bits.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core import bits
    >>> bits.ldexp_exact(jnp.float32(1.0), jnp.int32(-127)).item() == 2.0**-127
    True
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmx._src.core.dtypes import as_array

MANTISSA_BITS = 23
MANTISSA_MASK = (1 << MANTISSA_BITS) - 1
EXPONENT_BIAS = 127
E8M0_NAN = 0xFF


def where(condition, x, y) -> jnp.ndarray:
    """``jnp.where(condition, x, y)``, with a constant operand (a Python or 0-d scalar) filled in
    from the other operands' elements instead of broadcast from a literal (:func:`filled_like`).

    A literal broadcast depends on nothing, so JAX's partial evaluation puts it in the known part
    of a linearized or rematerialized function, where it becomes a residual; ``lax.scan`` hoists
    such a loop-invariant residual out of the loop, materialized at full size (one float32 or
    int32 per element of every quantized tensor). The filled constant is the same value, and XLA
    folds it back to a broadcast inside the loop.

    Example:
        >>> import jax.numpy as jnp
        >>> where(jnp.array([True, False]), 128, jnp.array([1, 2])).tolist()
        [128, 2]
    """
    constant = [_is_constant(v) for v in (x, y)]
    if not any(constant):
        return jnp.where(condition, x, y)
    dtype = jnp.result_type(x, y)
    arrays = [v for v, c in zip((x, y), constant, strict=True) if not c]
    ref = arrays[0] if arrays else jnp.asarray(condition)
    x, y = (filled_like(ref, v, dtype) if c else v for v, c in zip((x, y), constant, strict=True))
    return jnp.where(condition, x, y)


def filled_like(ref: jnp.ndarray, value, dtype) -> jnp.ndarray:
    """``value`` in ``dtype``, shaped like ``ref`` and computed from its bits (``bits & 0 | value``,
    exact; XLA folds it to a broadcast of ``value``)."""
    dtype = jnp.dtype(dtype)
    unsigned = jnp.dtype(f"uint{dtype.itemsize * 8}")
    ref = jnp.asarray(ref)
    if ref.dtype == jnp.bool_:
        ref_bits = ref.astype(unsigned)
    else:
        ref_bits = lax.bitcast_convert_type(ref, jnp.dtype(f"uint{ref.dtype.itemsize * 8}"))
        ref_bits = ref_bits.astype(unsigned)
    pattern = np.asarray(value, dtype).view(unsigned)
    out = (ref_bits & unsigned.type(0)) | pattern
    return out.astype(dtype) if dtype == jnp.bool_ else lax.bitcast_convert_type(out, dtype)


def _is_constant(v) -> bool:
    """Whether ``v`` is a scalar known at trace time (a Python or NumPy scalar, a 0-d array)."""
    if isinstance(v, (bool, int, float, np.generic)):
        return True
    return (
        isinstance(v, (np.ndarray, jax.Array))
        and np.ndim(v) == 0
        and not isinstance(v, jax.core.Tracer)
    )


def to_bits(x: jnp.ndarray) -> jnp.ndarray:
    """float32 -> its int32 bit pattern."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def from_bits(bits: jnp.ndarray) -> jnp.ndarray:
    """int32 bit pattern -> float32."""
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def upcast_exact(x: jnp.ndarray) -> jnp.ndarray:
    """Converts float16/bfloat16/float32 to float32 exactly, subnormals included."""
    if x.dtype == jnp.bfloat16:
        bits16 = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32)
        return from_bits(bits16 << 16)
    return x.astype(jnp.float32)


BYTE_DTYPES = tuple(
    jnp.dtype(t) for t in (jnp.uint8, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e8m0fnu)
)
"""The 8-bit dtypes jaxmx moves as raw bytes: codes, E8M0 scales and ``uint8`` itself."""


SCALE_DTYPES = (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e8m0fnu))
"""The dtypes an E8M0 scale array may come in."""


def as_bytes(x: jnp.ndarray, what: str = "array", dtypes=BYTE_DTYPES) -> jnp.ndarray:
    """The ``uint8`` view of an 8-bit array; a TypeError naming ``what`` for other dtypes.

    ``dtypes`` restricts what is accepted (default: any of :data:`BYTE_DTYPES`).
    """
    x = as_array(x, what)
    if x.dtype not in dtypes:
        names = ", ".join(d.name for d in dtypes)
        raise TypeError(f"{what} must have an 8-bit dtype ({names}), got {x.dtype}")
    return x if x.dtype == jnp.uint8 else lax.bitcast_convert_type(x, jnp.uint8)


def from_bytes(x: jnp.ndarray, dtype) -> jnp.ndarray:
    """The inverse of :func:`as_bytes`: ``uint8`` bytes viewed as the 8-bit ``dtype``."""
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def to_wire(x: jnp.ndarray, *, all_bytes: bool = False) -> jnp.ndarray:
    """``x`` as it crosses devices (a collective, a ``custom_partitioning`` boundary), bit for
    bit: an 8-bit array (FP8 codes, E8M0 scales, int8) as ``uint8`` of the same shape, FP4 codes
    as their ``uint4`` bits, any other array as it is. :func:`from_wire` undoes it.

    XLA:CPU widens a collective of 8-bit or 4-bit floats (E4M3 and FP4 to float16, E8M0 to
    float32); the unsigned integers move one byte per element (FP6 codes are ``uint8`` already).

    ``all_bytes``: an array wider than a byte (a float32 scale) too becomes ``uint8``, its bytes
    on a new trailing axis of its itemsize.

    Example:
        >>> import jax.numpy as jnp
        >>> to_wire(jnp.array([1.0, -2.0], jnp.float8_e4m3fn)).tolist()
        [56, 192]
        >>> to_wire(jnp.ones(2)).dtype, to_wire(jnp.ones(2), all_bytes=True).shape
        (dtype('float32'), (2, 4))
    """
    x = jnp.asarray(x)
    if x.dtype in (jnp.uint8, jnp.uint4):  # already on the wire
        return x
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits == 4:
        return lax.bitcast_convert_type(x, jnp.uint4)
    if x.dtype.itemsize == 1 or all_bytes:
        return lax.bitcast_convert_type(x, jnp.uint8)
    return x


def from_wire(x: jnp.ndarray, dtype) -> jnp.ndarray:
    """The array of ``dtype`` that :func:`to_wire` sent as ``x`` (``x`` itself where its dtype
    is ``dtype``).

    Example:
        >>> import jax.numpy as jnp
        >>> from_wire(jnp.array([56, 192], jnp.uint8), jnp.float8_e4m3fn).astype(float).tolist()
        [1.0, -2.0]
    """
    return from_bytes(x, dtype)  # the same bit view, whatever the wire dtype


def pack_nibbles(x: jnp.ndarray) -> jnp.ndarray:
    """``uint8 [..., n / 2]``: the 4-bit values ``x`` (``uint4 [..., n]``, ``n`` even) two per
    byte, element ``2i`` in the low nibble and ``2i + 1`` in the high one (CUDA's
    ``__nv_fp4x2`` order). :func:`unpack_nibbles` undoes it.

    Example:
        >>> import jax.numpy as jnp
        >>> pack_nibbles(jnp.array([1, 2, 15, 0], jnp.uint4)).tolist()
        [33, 15]
    """
    nibbles = x.astype(jnp.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_nibbles(x: jnp.ndarray) -> jnp.ndarray:
    """``uint4 [..., 2 n]``: the nibbles of ``x`` (``uint8 [..., n]``), low nibble first.

    Example:
        >>> import jax.numpy as jnp
        >>> unpack_nibbles(jnp.array([33, 15], jnp.uint8)).astype(int).tolist()
        [1, 2, 15, 0]
    """
    pairs = jnp.stack([x & 0xF, x >> 4], axis=-1)
    return pairs.reshape(*x.shape[:-1], 2 * x.shape[-1]).astype(jnp.uint4)


def pack_twelve(x: jnp.ndarray) -> jnp.ndarray:
    """``uint8 [3 n / 2]``: the 12-bit codes ``x`` (the low bits of ``uint16``, ``n = x.size``
    even) two per three bytes, flattened: code ``2i`` in byte ``3i`` and the low nibble of byte
    ``3i + 1``, code ``2i + 1`` in its high nibble and byte ``3i + 2`` (little-endian 24-bit
    words). :func:`unpack_twelve` undoes it.

    Example:
        >>> import jax.numpy as jnp
        >>> pack_twelve(jnp.array([0xABC, 0x123], jnp.uint16)).tolist()  # 0x123ABC
        [188, 58, 18]
    """
    pairs = x.reshape(-1, 2).astype(jnp.uint32)
    word = (pairs[:, 0] & 0xFFF) | ((pairs[:, 1] & 0xFFF) << 12)
    out = jnp.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], axis=-1)
    return out.reshape(-1).astype(jnp.uint8)


def unpack_twelve(x: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """``uint16`` codes of ``shape`` from the bytes :func:`pack_twelve` made of them.

    Example:
        >>> import jax.numpy as jnp
        >>> unpack_twelve(jnp.array([188, 58, 18], jnp.uint8), (2,)).tolist() == [0xABC, 0x123]
        True
    """
    triples = x.reshape(-1, 3).astype(jnp.uint32)
    word = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
    codes = jnp.stack([word & 0xFFF, word >> 12], axis=-1)
    return codes.reshape(shape).astype(jnp.uint16)


def pow2(k: jnp.ndarray) -> jnp.ndarray:
    """2.0**k in float32 for integer k, exact; 0 below 2^-126 and inf above 2^127."""
    k = k.astype(jnp.int32)
    normal = from_bits(jnp.clip(k + EXPONENT_BIAS, 1, 255) << MANTISSA_BITS)
    return where(k < 1 - EXPONENT_BIAS, jnp.float32(0), normal)


def exponent_and_mantissa(amax_bits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(biased exponent, 23-bit mantissa)`` of the non-negative float32 with bits
    ``amax_bits``, subnormals normalized: ``amax = 2^(exponent - 127) * (1 + mantissa / 2^23)``
    for every non-zero finite amax (the exponent is below 1 for a subnormal; zero gives -149
    and mantissa 0). NaN and inf keep their exponent field 0xFF.

    Example:
        >>> import jax.numpy as jnp
        >>> e, m = exponent_and_mantissa(to_bits(jnp.float32(1.5 * 2.0**-130)))
        >>> int(e) - EXPONENT_BIAS, int(m) == 1 << 22     # 1.5 * 2^-130, a subnormal
        (-130, True)
    """
    field = amax_bits >> MANTISSA_BITS
    # a subnormal is m * 2^-149; m < 2^23 converts to float32 exactly, as a normal float
    m_bits = to_bits((amax_bits & MANTISSA_MASK).astype(jnp.float32))
    exponent = where(field == 0, (m_bits >> MANTISSA_BITS) - 149, field)
    mantissa = where(field == 0, m_bits & MANTISSA_MASK, amax_bits & MANTISSA_MASK)
    return exponent, mantissa


def scale_bytes(amax_bits: jnp.ndarray, emax: int, increment: jnp.ndarray) -> jnp.ndarray:
    """The E8M0 byte ``clamp(exponent(amax) + increment - emax, -127, 127) + 127`` (or 0xFF).

    ``amax_bits`` are the float32 bits of a non-negative amax (NaN/Inf have exponent 0xFF and map
    to the NaN byte); the exponent is ``floor(log2(amax))``, subnormals included
    (:func:`exponent_and_mantissa`). A zero amax yields byte 0, the smallest scale.

    Where ``emax >= 1`` a subnormal amax gives byte 0 with or without normalizing (its exponent
    is at most 0, the increment at most 1), so its exponent field is taken as it is.
    """
    exponent = exponent_and_mantissa(amax_bits)[0] if emax < 1 else amax_bits >> MANTISSA_BITS
    byte = jnp.clip(exponent + increment.astype(jnp.int32) - emax, 0, 254)
    return where(exponent == 0xFF, E8M0_NAN, byte)


def scale_by_pow2(x: jnp.ndarray, k: jnp.ndarray, axis: int | None = None) -> jnp.ndarray:
    """``x * 2**k`` for float32 x and integer k in [-127, 127], exact for subnormal x (k below
    -127 gives zero: the NaN-scale blocks' ``k = -128``).

    Results below 2^-126 are flushed to zero, which is harmless here: they are far below half
    the smallest subnormal of every MX element format and round to zero anyway. ``k = -127``
    (the largest block exponent where emax is 0: MXINT8) is applied to the exponent field, as
    no float32 factor (nor a product of two, which XLA may fold) is 2^-127 without flushing.

    ``axis``: ``k`` holds one exponent per block, without ``x``'s axis ``axis`` (the block's
    elements); its factors are computed per block and expanded there, where they meet the
    elements, so XLA has no reshape to sink through their arithmetic.
    """
    per_element = (lambda v: v) if axis is None else (lambda v: jnp.expand_dims(v, axis))
    bits = to_bits(x)
    is_subnormal = (bits & 0x7F800000) == 0
    magnitude = (bits & MANTISSA_MASK).astype(jnp.float32)  # the subnormal as an integer * 2^-149
    from_subnormal = where(bits < 0, -magnitude, magnitude) * per_element(pow2(k - 149))
    exponent = (bits >> MANTISSA_BITS) & 0xFF
    by_field = per_element(k == -127) & (exponent > 127) & (exponent < 0xFF)  # a normal result
    normal = where(by_field, from_bits(bits - (127 << MANTISSA_BITS)), x * per_element(pow2(k)))
    return where(is_subnormal, from_subnormal, normal)


_division = contextvars.ContextVar("jaxmx_division", default=None)


def divide(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """``a / b`` in float32, rounded to nearest even as IEEE division is (broadcast shapes).

    Where ``/`` alone is not: XLA turns a division by a broadcast value into a multiplication
    by its rounded reciprocal (one ulp off), so the divisor is materialised at the quotient's
    shape (batched under ``jax.vmap`` as the dividend is) behind an optimization barrier; and
    inside a kernel traced under :func:`division` (the Pallas quantizers compiled for a GPU,
    whose Triton lowering divides approximately) the given function divides instead.
    """
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    override = _division.get()
    if override is not None:
        return override(*jnp.broadcast_arrays(a, b))
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jnp.broadcast_to(a, shape) / lax.optimization_barrier(_batched_like(b, a, shape))


def _batched_like(b: jnp.ndarray, a: jnp.ndarray, shape) -> jnp.ndarray:
    """``b`` broadcast to ``shape``, computed from ``a`` too, so that under ``jax.vmap`` it is
    batched wherever ``a`` is: an unbatched divisor would be broadcast only after
    :func:`divide`'s barrier, where XLA again multiplies by its reciprocal. The bits of ``a``
    are masked out (``& 0``), so the values are ``b``'s, NaN and infinities included. Both are
    read as bits before their broadcast: a constant operand leaves XLA no work at ``shape``."""
    b_bits = jnp.broadcast_to(to_bits(b), shape)
    return from_bits(b_bits | jnp.broadcast_to(to_bits(a) & 0, shape))


@contextlib.contextmanager
def division(divide_fn):
    """Within this block :func:`divide` calls ``divide_fn(a, b)`` (same-shape float32 arrays)."""
    token = _division.set(divide_fn)
    try:
        yield
    finally:
        _division.reset(token)


def ldexp_exact(value: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """``value * 2**k`` in float32, exact including subnormal and infinite results.

    ``value`` is a decoded element (at most 24 significant bits, normal in float32 or zero), ``k``
    an integer in [-127, 127]. Built from the bits, so no flushing: e.g. 1.0 * 2^-127 gives the
    float32 subnormal 2^-127.
    """
    bits = to_bits(value)
    sign = bits & jnp.int32(-(2**31))
    exponent = (bits >> MANTISSA_BITS) & 0xFF
    new_exponent = exponent + k
    normal = bits + (k << MANTISSA_BITS)
    significand = (bits & MANTISSA_MASK) | (1 << MANTISSA_BITS)
    shift = jnp.clip(1 - new_exponent, 0, 31)
    subnormal = sign | (significand >> shift)
    out = where(new_exponent >= 1, normal, subnormal)
    out = where(new_exponent >= 0xFF, sign | 0x7F800000, out)
    passthrough = (exponent == 0) | (exponent == 0xFF)  # zeros, NaN and inf elements
    return from_bits(where(passthrough, bits, out))


def ldexp_rounded(x: jnp.ndarray, k: jnp.ndarray) -> jnp.ndarray:
    """``x * 2**k`` in float32 rounded once to nearest even, subnormal results included.

    ``x`` is any float32 (zeros, NaN and infinities pass through), ``k`` an integer; a result
    past float32's range is inf. Built from the bits, so XLA:CPU does not flush: e.g.
    ``5 * 2^-151`` (1.25 units of the smallest subnormal) gives ``2^-149``, where the float
    product would be zero there.
    """
    bits = to_bits(x)
    sign = bits & jnp.int32(-(2**31))
    exponent = (bits >> MANTISSA_BITS) & 0xFF
    significand = (bits & MANTISSA_MASK) | where(exponent > 0, 1 << MANTISSA_BITS, 0)
    # a subnormal x, normalized: the leading bit moved to bit 23, the exponent lowered to match
    lead = jnp.maximum(lax.clz(significand) - (31 - MANTISSA_BITS), 0)
    significand = significand << lead
    new_exponent = jnp.maximum(exponent, 1) - lead + k
    field = jnp.clip(new_exponent, 1, 0xFE) << MANTISSA_BITS
    normal = sign | field | (significand & MANTISSA_MASK)
    s = jnp.clip(1 - new_exponent, 1, 26)  # the right shift into the subnormal range
    q = significand >> s
    rest = significand & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).astype(jnp.int32)
    out = where(new_exponent >= 1, normal, sign | q)  # a carry to 2^23 is 2^-126: right
    out = where(new_exponent > 0xFE, sign | 0x7F800000, out)
    passthrough = (exponent == 0xFF) | ((bits & 0x7FFFFFFF) == 0)
    return from_bits(where(passthrough, bits, out))


def multiply_exact(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """``a * b`` in float32, rounded to nearest even including subnormal results.

    ``a`` has at most 7 significant bits (e.g. a decoded element times a decoded E4M3 scale) and
    both are normal, zero, infinite or NaN. Products of at least ``2^-126`` come from the float
    multiply; smaller ones, which XLA:CPU would flush to zero, from integers: the product of the
    significands (< 2^31) shifted right with round to nearest even, whose bits are the subnormal
    result.
    """
    product = a * b
    a_bits, b_bits = to_bits(a), to_bits(b)
    a_exp = (a_bits >> MANTISSA_BITS) & 0xFF
    b_exp = (b_bits >> MANTISSA_BITS) & 0xFF
    a_int = ((a_bits & MANTISSA_MASK) | (1 << MANTISSA_BITS)) >> 17  # 7 bits, exact
    b_int = (b_bits & MANTISSA_MASK) | (1 << MANTISSA_BITS)
    p = a_int * b_int  # < 2^31; |a * b| = p * 2^(a_exp + b_exp - 283), biased exponents
    shift = 134 - a_exp - b_exp  # p * 2^-shift in units of 2^-149
    s = jnp.clip(shift, 1, 30)
    q = p >> s
    rest = p & ((1 << s) - 1)
    half = 1 << (s - 1)
    q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).astype(jnp.int32)
    q = where(shift == 31, (p > (1 << 30)).astype(jnp.int32), q)
    q = where(shift > 31, 0, q)
    sign = (a_bits ^ b_bits) & jnp.int32(-(2**31))
    tiny = from_bits(q | sign)
    normal_inputs = (a_exp > 0) & (a_exp < 0xFF) & (b_exp > 0) & (b_exp < 0xFF)
    return where(normal_inputs & (shift >= 7), tiny, product)


def round_to_grid(v: jnp.ndarray, mbits: int, emin: int) -> jnp.ndarray:
    """float32 ``v`` rounded to nearest even on the grid of a float format with ``mbits``
    mantissa bits and smallest normal ``2^emin`` (subnormals included, no upper limit).

    The grid step of ``|v|`` is ``q = 2^(max(exponent(v), emin) - mbits)``. Adding ``M = 2^23 q``
    puts ``|v| < M`` in the binade of M, whose float32 spacing is q, so the sum rounds ``|v|`` to
    a multiple of q (ties to even) and subtracting M is exact. (M depends on ``v``: XLA folds
    ``(x + c) - c`` for a constant c.) Float32 subnormal ``v`` round to zero. The sign is copied
    from ``v``'s bits, so negatives that round to zero give -0, as element codes do.
    """
    v_bits = to_bits(v)
    magnitude = from_bits(v_bits & 0x7FFFFFFF)
    exponent = ((v_bits >> MANTISSA_BITS) & 0xFF) - EXPONENT_BIAS
    step_exponent = jnp.maximum(exponent, emin) - mbits
    big = from_bits((step_exponent + MANTISSA_BITS + EXPONENT_BIAS) << MANTISSA_BITS)
    rounded = (magnitude + big) - big
    return from_bits(to_bits(rounded) | (v_bits & jnp.int32(-(2**31))))


def encode_fp8(
    v: jnp.ndarray,
    mbits: int,
    emin: int,
    on_grid: bool = False,
    width: int = 8,
    out_dtype=jnp.uint8,
) -> jnp.ndarray:
    """Bytes of the ``width``-bit float (sign, exponent, ``mbits`` mantissa bits, min normal
    2^emin; 8 bits, or 6 for FP6 in the low bits of a byte; 12 for E5M6 in the low bits of a
    ``uint16``, with ``out_dtype=jnp.uint16``) nearest to ``v`` (round to nearest even), for
    float32 ``v`` within the format's finite range.

    Integer arithmetic on the float32 bits: the same bytes as XLA's convert, in about half its
    time on XLA:CPU. NaN becomes the all-ones magnitude (NaN in E4M3 and E5M2, the largest
    finite value in FP6, which has no NaN). ``on_grid``: ``v`` is already on the format's grid
    (:func:`round_to_grid`), so no rounding is done (and no ``round`` primitive used, which
    Pallas' Triton lowering lacks).
    """
    bits = to_bits(v)
    sign = (bits >> (32 - width)) & (1 << (width - 1))
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = from_bits(magnitude_bits)
    shift = MANTISSA_BITS - mbits
    # normal range: round the mantissa to mbits bits (ties to even), then rebias the exponent
    rounded = magnitude_bits + (1 << (shift - 1)) - 1 + ((magnitude_bits >> shift) & 1)
    normal = (rounded >> shift) - ((EXPONENT_BIAS - (1 - emin)) << mbits)
    # subnormal range: a multiple of the smallest subnormal, 2^(emin - mbits)
    subnormal = magnitude * 2.0 ** (mbits - emin)
    if not on_grid:
        subnormal = lax.round(subnormal, lax.RoundingMethod.TO_NEAREST_EVEN)
    code = where(magnitude < 2.0**emin, subnormal.astype(jnp.int32), normal)
    code = where(jnp.isnan(v), (1 << (width - 1)) - 1, code) | sign
    return code.astype(out_dtype)


def decode_fp8(
    code: jnp.ndarray, mbits: int, emin: int, ieee_specials: bool, width: int = 8
) -> jnp.ndarray:
    """float32 values of ``width``-bit float bytes (the inverse of :func:`encode_fp8`), exactly.

    ``ieee_specials``: the all-ones exponent holds inf and NaN (E5M2, E5M6); otherwise only the
    all-ones magnitude is NaN (E4M3), or, for 6-bit floats, nothing is (FP6 has no specials).
    """
    code = code.astype(jnp.int32)
    sign_bit = 1 << (width - 1)
    sign = (code & sign_bit) << (32 - width)
    magnitude = code & (sign_bit - 1)
    shift = MANTISSA_BITS - mbits
    normal = (magnitude + ((EXPONENT_BIAS - (1 - emin)) << mbits)) << shift
    subnormal = to_bits(magnitude.astype(jnp.float32) * 2.0 ** (emin - mbits))
    out = from_bits(where(magnitude < (1 << mbits), subnormal, normal) | sign)
    if ieee_specials:
        top = sign_bit - (1 << mbits)  # exponent all ones, mantissa zero: inf
        out = where(magnitude == top, where(sign != 0, -jnp.inf, jnp.inf), out)
        return where(magnitude > top, jnp.nan, out)
    if width < 8:
        return out
    return where(magnitude == sign_bit - 1, jnp.nan, out)
