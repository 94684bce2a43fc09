"""Stochastic rounding of scaled elements to the element grid.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmx._src.core.formats import get_format
    >>> from jaxmx._src.quantize.rounding import round_stochastically
    >>> noise = jax.random.uniform(jax.random.key(0), (10000,))
    >>> up = round_stochastically(jnp.full((10000,), 1.0625), get_format("mxfp8_e4m3"), noise)
    >>> sorted(set(up.tolist())), round(float(up.mean()), 2)   # 1.0625 between 1 and 1.125
    ([1.0, 1.125], 1.06)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmx._src.core import bits, exponents
from jaxmx._src.core.formats import Format
from jaxmx._src.quantize.draws import uniform_draws


def uniform_noise(key, shape, *, tied_to: jax.Array | None = None) -> jax.Array | None:
    """The uniform [0, 1) draws of stochastic rounding for blocked elements of ``shape``
    (:func:`~jaxmx._src.core.blocks.blocked`'s layout; :mod:`draws`), or None without a key;
    ``tied_to``: the array they round (:func:`~jaxmx._src.quantize.draws.uniform_draws`)."""
    return None if key is None else uniform_draws(key, shape, tied_to=tied_to)


def rounding(f: Format, noise):
    """The rounding of scaled elements before clipping: stochastic with ``noise``, else none
    (the encoder rounds to nearest even)."""
    if noise is None:
        return lambda values: values
    return lambda values: round_stochastically(values, f, noise)


def round_stochastically(scaled, f: Format, noise):
    """Rounds ``scaled`` to the element grid up or down with probability by distance."""
    magnitude = jnp.abs(scaled)
    exponent = (bits.to_bits(magnitude) >> bits.MANTISSA_BITS) - bits.EXPONENT_BIAS
    quantum_exp = jnp.maximum(exponent, f.emin) - f.mbits
    units = magnitude * exponents.pow2(-quantum_exp)  # exact: < 2^(mbits + 1)
    whole = jnp.floor(units)
    # up with probability frac(units); not floor(units + noise), whose float32 sum can round up
    # to the next integer and move an exactly representable value (p ~ 2^-21)
    up = (noise < units - whole).astype(jnp.float32)  # units - whole is exact
    rounded = (whole + up) * exponents.pow2(quantum_exp)
    return bits.where(jnp.isfinite(scaled), jnp.copysign(rounded, scaled), scaled)
