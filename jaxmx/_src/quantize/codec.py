"""The element and scale codec: float32 values to and from element codes (one
:class:`ElementCodec` per way of holding them), E8M0 scale bytes.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.core.formats import get_format
    >>> from jaxmx._src.quantize.codec import decode_elements, encode
    >>> f = get_format("mxfp8_e4m3")
    >>> decode_elements(encode(jnp.array([1.0, -0.3, 448.0]), f), f).tolist()
    [1.0, -0.3125, 448.0]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmx._src.core import bits, exponents, minifloat_codec, wire
from jaxmx._src.core.formats import Format


class ElementCodec:
    """How one :attr:`~jaxmx._src.core.formats.Format.coding` turns float32 values into element
    codes and back. This base class is the ``"cast"`` coding (a dtype XLA casts to: E2M1); the
    subclasses override what their coding does differently.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx._src.core.formats import get_format
        >>> f = get_format("mxint8")
        >>> codec = codec_of(f)
        >>> codec.encode(jnp.array([0.3, -1.0]), f).tolist()    # integers in units of 2^-6
        [19, -64]
    """

    def encode(self, values: jax.Array, f: Format, on_grid: bool = False) -> jax.Array:
        """RNE cast of in-range float32 values to the element codes (``on_grid``: the values
        are already on the element grid, see :meth:`to_grid`)."""
        return values.astype(f.dtype)

    def decode(self, data: jax.Array, f: Format) -> jax.Array:
        """float32 values of element codes, exactly."""
        return data.astype(jnp.float32)

    def to_grid(self, values: jax.Array, f: Format) -> jax.Array:
        """In-range float32 ``values`` rounded to nearest even on the element grid."""
        return minifloat_codec.round_to_grid(values, f.mbits, f.emin)

    def kernel_dtype(self, f: Format):
        """The dtype a Pallas kernel writes the codes in."""
        return f.dtype

    def kernel_codes(self, on_grid: jax.Array, f: Format) -> jax.Array:
        """The codes of values on the grid, in :meth:`kernel_dtype` (no ``round`` primitive,
        which Triton's lowering lacks)."""
        return self.encode(on_grid, f, on_grid=True)

    def from_kernel(self, data: jax.Array, f: Format) -> jax.Array:
        """A kernel's codes (:meth:`kernel_dtype`) as ``f``'s code dtype."""
        return data

    def as_bytes(self, data: jax.Array) -> jax.Array:
        """``uint8`` bytes holding the codes ``data`` (a TypeError for codes not of 8 bits)."""
        return wire.as_bytes(data)

    def from_bytes(self, saved: jax.Array, f: Format, shape: tuple[int, ...]) -> jax.Array:
        """The codes of ``shape`` that :meth:`as_bytes` made ``saved`` of."""
        return wire.from_bytes(saved, f.dtype)


class _Bytes(ElementCodec):
    """Floats one per byte (FP8, FP6 in ``uint8``), by integer arithmetic on their bits."""

    def encode(self, values, f, on_grid=False):
        return wire.from_bytes(self._bytes(values, f, on_grid), f.dtype)

    def decode(self, data, f):
        return minifloat_codec.decode_fp8(
            wire.as_bytes(data), f.mbits, f.emin, ieee_specials=f.has_inf, width=f.bits
        )

    def kernel_dtype(self, f):
        return jnp.uint8  # Triton stores uint8 on every GPU, fp8 types only on some

    def kernel_codes(self, on_grid, f):
        return self._bytes(on_grid, f, on_grid=True)

    def from_kernel(self, data, f):
        return wire.from_bytes(data, f.dtype)

    @staticmethod
    def _bytes(values, f, on_grid):
        return minifloat_codec.encode_fp8(values, f.mbits, f.emin, on_grid, width=f.bits)


class _Words(ElementCodec):
    """Floats in the low bits of 16-bit integers (E5M6 in ``uint16``), by integer arithmetic on
    their bits; two codes in three bytes when saved as bytes."""

    def encode(self, values, f, on_grid=False):
        return minifloat_codec.encode_fp8(
            values, f.mbits, f.emin, on_grid, width=f.bits, out_dtype=f.dtype
        )

    def decode(self, data, f):
        return minifloat_codec.decode_fp8(
            data, f.mbits, f.emin, ieee_specials=f.has_inf, width=f.bits
        )

    def as_bytes(self, data):
        return wire.pack_twelve(data)

    def from_bytes(self, saved, f, shape):
        return wire.unpack_twelve(saved, shape)


class _Integers(ElementCodec):
    """Two's-complement integers ``code * 2^-mbits`` (MXINT8), which have no -0."""

    def encode(self, values, f, on_grid=False):
        return integer_codes(values if on_grid else self.to_grid(values, f), f)

    def decode(self, data, f):
        return data.astype(jnp.float32) * 2.0**-f.mbits

    def to_grid(self, values, f):
        on_grid = super().to_grid(values, f)
        return bits.where(on_grid == 0, 0.0, on_grid)  # a negative rounded to zero is +0


CODECS = {"bytes": _Bytes(), "words": _Words(), "integers": _Integers(), "cast": ElementCodec()}
"""The element codec of each :data:`~jaxmx._src.core.formats.CODINGS` entry."""


def codec_of(f: Format) -> ElementCodec:
    """The element codec of format ``f``."""
    return CODECS[f.coding]


def encode(values: jax.Array, f: Format, on_grid: bool = False) -> jax.Array:
    """RNE cast of in-range float32 values to the element codes (``on_grid``: the values are
    already on the element grid, see :func:`to_grid`)."""
    return codec_of(f).encode(values, f, on_grid)


def to_grid(values: jax.Array, f: Format) -> jax.Array:
    """In-range float32 ``values`` rounded to nearest even on ``f``'s element grid: the decoded
    values of their codes (integer elements have no -0: a negative that rounds to zero is +0).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx._src.core.formats import get_format
        >>> to_grid(jnp.array([0.3, -0.001, 1.0]), get_format("mxint8")).tolist()  # 2^-6 grid
        [0.296875, 0.0, 1.0]
    """
    return codec_of(f).to_grid(values, f)


def integer_codes(on_grid: jax.Array, f: Format) -> jax.Array:
    """The integer codes ``v * 2^mbits`` of values on ``f``'s grid (NaN, which only a block with
    the NaN scale holds, gives code 0).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxmx._src.core.formats import get_format
        >>> integer_codes(jnp.array([0.296875, -1.984375]), get_format("mxint8")).tolist()
        [19, -127]
    """
    units = bits.where(jnp.isnan(on_grid), 0.0, on_grid * 2.0**f.mbits)  # exact
    return units.astype(f.dtype)


def decode_elements(data: jax.Array, f: Format) -> jax.Array:
    """float32 values of element codes of format ``f``, exactly."""
    return codec_of(f).decode(data, f)


def scale_exponent_bytes(scale: jax.Array) -> jax.Array:
    """The E8M0 bytes of ``scale`` as int32 (the scale is ``2^(byte - 127)``, 255 is NaN)."""
    return wire.as_bytes(scale, "MX scales", wire.SCALE_DTYPES).astype(jnp.int32)


def scale_back(values: jax.Array, byte: jax.Array) -> jax.Array:
    """``values * 2^(byte - 127)`` exactly (subnormals included), NaN where ``byte`` is 0xFF."""
    k = jnp.minimum(byte, 254) - bits.EXPONENT_BIAS
    return bits.where(byte == exponents.E8M0_NAN, jnp.nan, exponents.ldexp_exact(values, k))
