"""8-bit arrays as bytes, arrays as they cross devices, and narrow codes packed into bytes.

:func:`as_bytes` / :func:`from_bytes` view codes and E8M0 scales as ``uint8``;
:func:`to_wire` / :func:`from_wire` are the bit-for-bit form of an array in a collective (XLA:CPU
widens 8-bit and 4-bit floats there); :func:`pack_nibbles` puts 4-bit values two per byte and
:func:`pack_twelve` 12-bit codes two per three bytes.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core import wire
    >>> wire.as_bytes(jnp.array([1.0, 2.0], jnp.float8_e4m3fn)).tolist()
    [56, 64]
    >>> wire.pack_nibbles(jnp.array([1, 2], jnp.uint4)).tolist()
    [33]
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.dtypes import as_array

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
