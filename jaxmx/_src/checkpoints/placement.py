"""Where a loaded checkpoint's arrays go: a numpy array, or an MXArray of numpy leaves, copied
out of the memory-mapped file onto the devices a sharding names, each device receiving only
its slice.

Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("x",))
    >>> s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    >>> placed("norm.weight", np.ones(4, np.float32), s).sharding == s
    True
    >>> placed("norm.weight", np.ones(4, np.float32), lambda name, value: None).shape
    (4,)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxmx._src.checkpoints.safetensors_files import CheckpointError
from jaxmx._src.core.mxarray import MXArray

Tensor = MXArray | jax.Array
Sharding = jax.sharding.Sharding | Callable[[str, Tensor], jax.sharding.Sharding | None] | None
"""``load``'s ``sharding``: ``None`` (the default device), one sharding for every array, or a
function ``(name, value) -> Sharding | None``."""


def placed(name: str, value, sharding: Sharding) -> Tensor:
    """``value`` (numpy, or an MXArray of numpy leaves) on the devices ``sharding`` names,
    copied out of the memory-mapped file. An MXArray's codes and scales take the same sharding,
    its tensor scale is replicated."""
    s = sharding(name, value) if callable(sharding) else sharding
    if isinstance(value, MXArray):
        g = value.global_scale
        return MXArray(
            _put(name, value.data, s),
            _put(f"{name} (scales)", value.scale, s),
            value.fmt,
            value.axis,
            value.shape,
            value.tile,
            None if g is None else _put(f"{name} (tensor scale)", g, _replicated(s)),
        )
    return _put(name, value, s)


def _put(name: str, x: np.ndarray, s) -> jax.Array:
    if s is None:
        return jax.device_put(np.array(x))
    try:
        return jax.make_array_from_callback(x.shape, s, lambda index: np.array(x[index]))
    except ValueError as e:
        raise CheckpointError(f"{name}: cannot place {list(x.shape)} on {s}: {e}") from None


def _replicated(s):
    if s is None or not isinstance(s, jax.sharding.NamedSharding):
        return s
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())
