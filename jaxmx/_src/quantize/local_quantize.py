"""A weight quantized where each shard lives: tiled MX quantization as a ``custom_partitioning``.

Left to XLA, the reshapes and transposes of 2-D tile quantization (``Recipe.weight_tile``) of a
weight sharded along both of its last dims are partitioned by gathering float32 tiles across
devices. :func:`local_quantize` keeps the weight's sharding instead: every dim whose shards hold
whole tiles stays sharded and each device quantizes its own tiles (the same codes and scales as
one device: a tile's scale depends only on its own elements); a dim that would cut a tile is
gathered first (by XLA, in high precision), with one warning naming the dim. NVFP4's tensor
scale depends on every shard: it is computed first (XLA reduces one scalar amax across the
devices) and handed to each device's quantization.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.quantize.local_quantize import local_quantize
    >>> q = local_quantize(jnp.ones((1, 64, 64)), "mxfp8_e4m3", "floor", (32, 32))
    >>> q.scale.shape
    (1, 2, 2)
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmx._src.core import wire
from jaxmx._src.core.block_sharding import BlockShardingError, mesh_axes, spec_of
from jaxmx._src.core.blocks import padded_shape
from jaxmx._src.core.exportable import exportable
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.quantize.quantize import quantize
from jaxmx._src.quantize.scales import rule_of


def local_quantize(w: jax.Array, fmt: str, scale_mode: str, tile: tuple[int, int]) -> MXArray:
    """``quantize(w, fmt, axis=-1, scale_mode=scale_mode, tile=tile)`` of ``w`` [..., N, K],
    each device quantizing its own whole tiles (NVFP4: with the tensor scale of all of ``w``)."""
    f = get_format(fmt)
    g = rule_of(f).tensor_scale(w)
    args = (w,) if g is None else (w, g.reshape((1,) * w.ndim))
    data, scale = _partitioned(fmt, scale_mode, tuple(tile), w.shape, g is not None)(*args)
    return MXArray(
        wire.from_wire(data, f.dtype),
        wire.from_wire(scale, f.scale_dtype),
        fmt,
        w.ndim - 1,
        w.shape,
        tuple(tile),
        g,
    )


@functools.cache
def _partitioned(
    fmt: str, scale_mode: str, tile: tuple[int, int], shape: tuple[int, ...], tensor_scaled: bool
):
    ndim = len(shape)

    def local(w, *g):  # g: the tensor scale, shaped [1, ..., 1]
        global_scale = g[0].reshape(()) if g else None
        q = quantize(w, fmt, axis=-1, scale_mode=scale_mode, tile=tile, global_scale=global_scale)
        return wire.to_wire(q.data), wire.to_wire(q.scale)

    @custom_partitioning
    def quantized(*args):
        return local(*args)

    batched = jax.custom_batching.custom_vmap(
        exportable(quantized, local, "jaxmx.dot_general (a tiled weight's quantization)")
    )

    @batched.def_vmap
    def rule(axis_size, in_batched, w, *g):  # custom_partitioning has no batching rule of its own
        if tensor_scaled:  # a tensor scale per vmapped weight: quantized one by one
            return jax.vmap(local)(w, *g), (True, True)
        return _partitioned(fmt, scale_mode, tile, w.shape, tensor_scaled)(w), (True, True)

    def layout(mesh, arg_shapes):
        (shape,) = arg_shapes
        try:
            have = spec_of(shape, mesh, "jaxmx.dot_general", tile[1])
        except BlockShardingError:
            have = (None,) * ndim
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        sides = (1,) * (ndim - 2) + tile
        spec = []
        for d, (entry, size, side) in enumerate(zip(have, shape.shape, sides, strict=True)):
            n = math.prod(sizes[a] for a in mesh_axes(entry))
            if n > 1 and (size % n or (size // n) % side):
                warnings.warn(
                    f"jaxmx.dot_general: a weight {tuple(shape.shape)} quantized in {tile} tiles "
                    f"is sharded along its dim {d} over mesh axes {mesh_axes(entry)} into shards "
                    f"that cut its {side}-element tiles; XLA gathers that dim in high precision "
                    f"first. Make its per-shard size a multiple of {side}.",
                    stacklevel=2,
                )
                entry = None
            spec.append(entry)
        arg = NamedSharding(mesh, P(*spec))
        return arg, (arg, arg)

    def partition(mesh, arg_shapes, result_shape):
        arg, results = layout(mesh, arg_shapes[:1])
        replicated = (NamedSharding(mesh, P()),) * (len(arg_shapes) - 1)
        return mesh, local, results, (arg, *replicated)

    def infer(mesh, arg_shapes, result_shape):
        return layout(mesh, arg_shapes[:1])[1]

    # the codes share the weight's factors (a padded dim has one of its own), the scales have
    # their own: the callback gives them the weight's sharding
    letters = [f"d{i}" for i in range(ndim)]
    padded = padded_shape(shape, ndim - 1, tile[1], tile)
    data = [
        f"d{i}" if n == p else f"p{i}" for i, (n, p) in enumerate(zip(shape, padded, strict=True))
    ]
    scale = [f"s{i}" for i in range(ndim)]
    operands = [" ".join(letters)] + [" ".join(f"g{i}" for i in range(ndim))] * tensor_scaled
    quantized.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=f"{', '.join(operands)} -> {' '.join(data)}, {' '.join(scale)}",
        decode_shardings=False,
    )
    return jax.jit(batched)
