"""The code maps of the 8-bit and 4-bit moments and the quantization of values in [-1, 1] to them.

A code map is a sorted table of float32 values in [-1, 1]; a code is an index into it. The first
moment takes a signed map, the second (non-negative, wide range) an unsigned one:

- ``DYNAMIC_8BIT_SIGNED`` / ``DYNAMIC_8BIT_UNSIGNED``: the dynamic (decimal exponent plus
  linear fraction) maps of 8-bit optimizers (Dettmers et al., arXiv:2110.02861), 256 values;
- ``DYNAMIC_4BIT_SIGNED``: the 4-bit dynamic map with three exponent bits (16 values);
- ``LINEAR_4BIT_UNSIGNED``: ``k / 16`` for ``k = 1 .. 16`` (no zero), the 4-bit second-moment
  map of Li et al. (arXiv:2309.01507).

These are the maps of torchao's ``torchao.optim`` low-bit Adam, built the same way in float32.
:func:`quantize_to_map` picks the nearest map value (a tie goes to the larger one).

Example:
    >>> import jax.numpy as jnp
    >>> table = DYNAMIC_8BIT_SIGNED
    >>> len(table), round(float(table[0]), 4), float(table[-1])
    (256, -0.993, 1.0)
    >>> quantize_to_map(jnp.array([0.03, 0.5]), LINEAR_4BIT_UNSIGNED).tolist()
    [0, 7]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _linspace32(start: float, end: float, n: int) -> np.ndarray:
    """``n`` evenly spaced float32 values: with the float32 step ``(end - start) / (n - 1)``, the
    first half ``start + i * step`` and the second ``end - (n - 1 - i) * step``, each rounded
    once to float32 (a fused multiply-add; float64 holds the product exactly)."""
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64((end32 - start32) / np.float32(n - 1))
    i = np.arange(n)
    up = np.float64(start32) + step * i
    down = np.float64(end32) - step * (n - 1 - i)
    return np.where(i < n // 2, up, down).astype(np.float32)


def dynamic_map(*, signed: bool, exponent_bits: int, total_bits: int) -> np.ndarray:
    """The dynamic code map: for each decimal exponent ``10**(i - exponent_bits + 1)``, the
    midpoints of evenly spaced fractions in [0.1, 1] (more of them for larger exponents), their
    negatives if ``signed``, then 0 and 1; sorted, ``2**total_bits`` float32 values."""
    values: list[np.ndarray] = []
    fraction_bits = total_bits - 1 - exponent_bits
    for i in range(exponent_bits):
        n = 2 ** (i + fraction_bits) + 1 if signed else 2 ** (i + fraction_bits + 1) + 1
        bounds = _linspace32(0.1, 1.0, n)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        decade = np.float32(10.0 ** (i - exponent_bits + 1))
        values.append(decade * means)
        if signed:
            values.append(-decade * means)
    extra = 2**fraction_bits - 1
    if extra > 0:
        bounds = _linspace32(0.1, 1.0, extra + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        decade = np.float32(10.0 ** (exponent_bits - 1 - exponent_bits + 1))
        values.append(decade * means)
        if signed:
            values.append(-decade * means)
    values.append(np.array([0.0, 1.0], np.float32))
    table = np.sort(np.concatenate(values).astype(np.float32))
    if table.size != 2**total_bits:
        raise ValueError(f"a dynamic map of {total_bits} bits needs {2**total_bits} values")
    return table


DYNAMIC_8BIT_SIGNED = dynamic_map(signed=True, exponent_bits=7, total_bits=8)
DYNAMIC_8BIT_UNSIGNED = dynamic_map(signed=False, exponent_bits=7, total_bits=8)
DYNAMIC_4BIT_SIGNED = dynamic_map(signed=True, exponent_bits=3, total_bits=4)
LINEAR_4BIT_UNSIGNED = _linspace32(0.0, 1.0, 17)[1:]


def quantize_to_map(x: jnp.ndarray, table: np.ndarray) -> jnp.ndarray:
    """``uint8`` codes of ``x`` (float32, normally in [-1, 1]): the index of the nearest value of
    ``table`` (sorted, a power-of-two length); at a midpoint, the larger value. Values below the
    table's first entry take code 0, above its last the last code."""
    n = table.size
    values = jnp.asarray(table)
    codes = jnp.zeros(x.shape, jnp.int32)
    step = n // 2
    while step:
        codes = codes + jnp.where(x >= values[codes + step], step, 0)
        step //= 2
    up = jnp.minimum(codes + 1, n - 1)
    down_value, up_value = values[codes], values[up]
    codes = jnp.where(x - down_value >= (up_value - down_value) * 0.5, up, codes)
    return codes.astype(jnp.uint8)
