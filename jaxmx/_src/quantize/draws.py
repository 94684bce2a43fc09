"""The uniform draws of stochastic rounding: a keyed hash of each element's position.

Each draw is a pure function of the key and the element's index, computed elementwise, so
XLA fuses it into the rounding that reads it and no buffer of random bits is ever held (a
threefry draw of ``jax.random.uniform`` is computed in unfused ``uint32`` buffers of the
rounded tensor's size on XLA:CPU: a training step rounding its gradients that way needed
twice the temporary memory). The draws are not cryptographic; rounding needs uniform,
independent-looking bits, which the mixer gives.

The recipe (``tests/test_draws.py`` reproduces it in numpy):

- ``mix`` is the 32-bit integer finalizer ``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15;
  x *= 0x846CA68B; x ^= x >> 16`` (a bijection of ``uint32``; constants from C. Wellons'
  hash-prospector, "lowbias32").
- The seed folds the key's ``uint32`` words in order: ``s = 0x9E3779B9``, then
  ``s = mix(s ^ w)`` for each word ``w``.
- The shape's axes are split, from the last, into groups whose element count stays below
  ``2^32`` (one group for any tensor below four billion elements); ``h = s``, then for each
  group from the first ``h = mix(h ^ i)``, ``i`` the element's flat (row-major) index within
  the group; then ``h = mix(h + s)``.
- The draw is ``(h >> 8) * 2^-24``: a multiple of ``2^-24`` in ``[0, 1)``.

The index enters only through ``iota`` and ``reshape`` before it meets the key, or, with
``tied_to`` (the array being rounded), as the sum of per-axis ``iota`` s tied to that array: no
arithmetic on constants is left for XLA to fold at compile time (a fixed key is still an
argument of the compiled step), and nothing is left for ``lax.scan`` to move out of its loop.

Example:
    >>> import jax
    >>> u = uniform_draws(jax.random.key(0), (4, 1024))
    >>> u.dtype, bool((u >= 0).all() & (u < 1).all()), round(float(u.mean()), 1)
    (dtype('float32'), True, 0.5)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.materialize import tied

_GOLDEN = 0x9E3779B9
_WORD = 2**32  # uint32 arithmetic wraps here
_INDEX_LIMIT = _WORD  # a group of axes holds fewer elements than this


def mix(x: jax.Array) -> jax.Array:
    """The 32-bit finalizer (a bijection of ``uint32``) that every draw is made of."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _key_words(key) -> jax.Array:
    """The key's ``uint32`` words (a typed key's data, or a legacy ``uint32[2]`` key)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return jnp.asarray(key, jnp.uint32).reshape(-1)


def _seed(key) -> jax.Array:
    seed = jnp.uint32(_GOLDEN)
    words = _key_words(key)
    for i in range(words.shape[0]):
        seed = mix(seed ^ words[i])
    return seed


def _axis_groups(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The axes in groups, from the last, each with fewer than ``2^32`` elements in all."""
    groups: list[list[int]] = []
    count = _INDEX_LIMIT
    for axis in reversed(range(len(shape))):
        if count * shape[axis] >= _INDEX_LIMIT:
            groups.insert(0, [])
            count = 1
        groups[0].insert(0, axis)
        count *= shape[axis]
    return [tuple(g) for g in groups]


def _flat_index(shape: tuple[int, ...], axes: tuple[int, ...], tied_to) -> jax.Array:
    """Each element's row-major index within ``axes`` (consecutive), broadcast to ``shape``:
    an ``iota`` reshaped, no arithmetic; with ``tied_to``, the sum of each axis's ``iota``
    (:func:`~jaxmx._src.core.materialize.tied` to it) times its stride (arithmetic on values
    XLA cannot fold)."""
    group = tuple(shape[a] for a in axes)
    if tied_to is None:
        index = lax.iota(jnp.uint32, math.prod(group)).reshape(group)
        return lax.broadcast_in_dim(index, shape, axes)
    index = jnp.zeros((), jnp.uint32)
    for a in axes:
        stride = math.prod(shape[a + 1 : axes[-1] + 1])
        along = tied(lax.iota(jnp.uint32, shape[a]), to=tied_to)
        along = lax.broadcast_in_dim(along, shape, (a,))
        index = index + along * jnp.uint32(stride)
    return index


def uniform_draws(key, shape: tuple[int, ...], *, tied_to: jax.Array | None = None) -> jax.Array:
    """Float32 draws in ``[0, 1)`` (multiples of ``2^-24``), one per element of ``shape``,
    from ``key`` (a typed PRNG key or a legacy ``uint32[2]`` one); the module docstring
    gives the recipe.

    ``tied_to``: the array the draws round. The element indices are built from one ``iota``
    per axis, each :func:`~jaxmx._src.core.materialize.tied` to it (the same indices, bit for
    bit), so the draws are computed where that array is rounded. Draws from a key and
    positions alone depend on nothing that changes from one step of a ``lax.scan`` to the
    next: JAX's partial evaluation and XLA move them (or their full-size index) out of the
    loop, a 4-byte array of the rounded tensor's size held across the whole loop."""
    shape = tuple(int(d) for d in shape)
    if any(d >= _WORD for d in shape):
        raise ValueError(f"stochastic rounding: an axis of {shape} has 2^32 or more elements")
    if math.prod(shape) == 0:
        return jnp.zeros(shape, jnp.float32)
    seed = _seed(key)
    h = jnp.broadcast_to(seed, shape)
    for axes in _axis_groups(shape):
        h = mix(h ^ _flat_index(shape, axes, tied_to))
    h = mix(h + seed)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
