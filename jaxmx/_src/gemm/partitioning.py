"""The native MX GEMM's SPMD partitioning rule (``jax.experimental.custom_partitioning``).

:func:`partitioned_gemm` wraps a per-shard GEMM of TN operands (or of K-first ones,
``[..., K, rows]`` with scales ``[..., K/block, rows]``) so that XLA partitions it instead of
gathering its operands: rows M of the lhs, rows N of the rhs and the batch dims stay sharded, K is
sharded together with its K/32 scale blocks, and a sharded K ends in a float32 ``psum`` (or
a ``psum_scatter`` when the result is wanted sharded along the same mesh axes). 8-bit codes and
scales travel as ``uint8``. A K that would split a block raises :class:`BlockShardingError` from
the rule. (The emulated training GEMMs use the same plan: :mod:`jaxmx._src.gemm.gathered`.)

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.gemm.partitioning import partitioned_gemm
    >>> def per_shard(dtype):
    ...     return lambda a, b, sa, sb: (a.astype(dtype) @ b.astype(dtype).T)
    >>> gemm = partitioned_gemm(per_shard, jnp.float32, "example()", block=32)
    >>> x = jnp.ones((2, 32), jnp.float8_e4m3fn)
    >>> s = jnp.ones((2, 1), jnp.float8_e8m0fnu)
    >>> gemm(x, x, s, s).tolist()
    [[32.0, 32.0], [32.0, 32.0]]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmx._src.core import wire
from jaxmx._src.core.block_sharding import (
    BlockShardingError,
    ReducedAxis,
    mesh_axes,
    misaligned_message,
    spec_of,
)
from jaxmx._src.core.exportable import exportable

# The Shardy sharding rule. Factors: batch dims (...), rows m of the lhs, rows n of the rhs, the
# reduction K of the codes (k) and of their K/32 scales (kb). The partition callback shards the
# scales exactly like their codes. K and its blocks are not tied as the compound factor (kb 32):
# Shardy would then split a mesh axis that does not divide K/32 into sub-axes, which the
# partition callback cannot receive; as separate factors a misaligned K reaches the callback,
# which raises BlockShardingError. A K-first operand lists its factors the other way round.


def _rule(k_first: tuple[bool, bool]) -> str:
    a, b = (
        ("k m", "kb m") if k_first[0] else ("m k", "m kb"),
        ("k n", "kb n") if k_first[1] else ("n k", "n kb"),
    )
    return f"... {a[0]}, ... {b[0]}, ... {a[1]}, ... {b[1]} -> ... m n"


def partitioned_gemm(
    per_shard: Callable,
    out_dtype,
    where: str,
    block: int,
    k_first: tuple[bool, bool] = (False, False),
) -> Callable:
    """The GEMM ``per_shard(out_dtype)(a, b, a_scale, b_scale)``, partitioned by XLA (SPMD).

    Args:
        per_shard: ``per_shard(dtype)`` returns a function of ``a [..., M, K]``,
            ``b [..., N, K]`` and their compact scales ``[..., M, K/block]``,
            ``[..., N, K/block]`` that computes ``[..., M, N]`` in ``dtype``. It must be hashable
            (e.g. a cached module-level function).
        out_dtype: the result dtype.
        where: the API name used in error messages.
        block: the quantization block along K.
        k_first: per operand (a, b), whether it is K-first instead: ``[..., K, rows]`` with
            scales ``[..., K/block, rows]``.

    On one device ``per_shard`` runs as is. Under a multi-device ``jit``, XLA calls the rule
    with the shardings it propagated and ``per_shard`` runs on each device's blocks.
    """
    out_dtype = jnp.dtype(out_dtype)

    def gemm(a, b, a_scale, b_scale):
        args = (a, b, a_scale, b_scale)
        dtypes = tuple(jnp.dtype(x.dtype) for x in args)
        op = _partitioned(per_shard, out_dtype, dtypes, where, block, tuple(k_first))
        return op(*(wire.to_wire(x) for x in args))

    return gemm


@functools.cache
def _partitioned(per_shard: Callable, out_dtype, dtypes, where: str, block: int, k_first):
    def local(dtype, args):
        return per_shard(dtype)(*(wire.from_wire(x, t) for x, t in zip(args, dtypes, strict=True)))

    @custom_partitioning
    def gemm(a, b, a_scale, b_scale):
        return local(out_dtype, (a, b, a_scale, b_scale))

    def partition(mesh, arg_shapes, result_shape):
        p = plan(mesh, arg_shapes, result_shape, where, block, k_first)

        def lower(a, b, a_scale, b_scale):
            return reduced(p, lambda dtype: local(dtype, (a, b, a_scale, b_scale)), out_dtype)

        return mesh, lower, p.result_sharding, p.arg_shardings

    def infer(mesh, arg_shapes, result_shape):  # GSPMD propagation (Shardy uses the rule)
        return plan(mesh, arg_shapes, result_shape, where, block, k_first).result_sharding

    gemm.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_rule(k_first),
        reduction_factors=("k", "kb"),
        # Shardings reach the rule undecoded: a scale tensor split into mesh sub-axes (K/32 not
        # divisible by the shard count, i.e. a misaligned K) cannot become a NamedSharding, and
        # the rule reports that misalignment itself.
        decode_shardings=False,
    )
    return exportable(gemm, lambda *args: local(out_dtype, args), where)


def reduced(p: Plan, local: Callable, out_dtype):
    """The per-device GEMM ``local(dtype)`` under plan ``p``: as is where K is whole, else its
    float32 partial sums reduced (``psum``, or ``psum_scatter`` into a result dim) across the
    devices that split K, then rounded to ``out_dtype`` once."""
    if not p.k:
        return local(out_dtype)
    out = local(jnp.dtype(jnp.float32))
    for axis, axes in p.scatter:
        out = lax.psum_scatter(out, axes, scatter_dimension=axis, tiled=True)
    if p.reduce:
        out = lax.psum(out, p.reduce)
    return out.astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class Plan:
    k: tuple[str, ...]  # mesh axes that split K
    reduce: tuple[str, ...]  # ... summed with psum
    scatter: tuple[tuple[int, tuple[str, ...]], ...]  # (output dim, axes) summed by psum_scatter
    arg_shardings: tuple[NamedSharding, ...]
    result_sharding: NamedSharding


def plan(
    mesh, arg_shapes, result_shape, where: str, block: int, k_first=(False, False), split_k=True
) -> Plan:
    """Consistent shardings for the four operands and the result, from the propagated ones.

    Each mesh axis is used once: batch dims first (from the lhs, else the rhs), then the lhs rows
    M, the rhs rows N (so a weight sharded like the activations' rows is gathered, FSDP style),
    then K (from the lhs, else the rhs; with ``split_k=False`` K stays whole). The scales
    follow their data (a K-first operand and its scales have rows and K the other way round).
    """
    a, b = arg_shapes[0], arg_shapes[1]
    nb = len(a.shape) - 2
    # the dims of (rows, K) in each operand
    (a_rows, a_k), (b_rows, b_k) = ((nb + 1, nb) if f else (nb, nb + 1) for f in k_first)
    a_spec, b_spec = spec_of(a, mesh, where, block), spec_of(b, mesh, where, block)
    used: set[str] = set()

    def take(*entries):
        for entry in entries:
            axes = tuple(x for x in mesh_axes(entry) if x not in used)
            if axes:
                used.update(axes)
                return axes
        return ()

    batch = [take(a_spec[i], b_spec[i]) for i in range(nb)]
    m = take(a_spec[a_rows])
    n = take(b_spec[b_rows])
    k = take(a_spec[a_k], b_spec[b_k]) if split_k else ()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    k_size, k_shards = a.shape[a_k], math.prod(sizes[x] for x in k)
    if k and k_size % (block * k_shards):
        axis = ReducedAxis(a_k, "K", "the contracting dimension")
        raise BlockShardingError(
            misaligned_message(where, "the lhs", axis, k_size, k, k_shards, block)
        )

    # A result wanted sharded along K's mesh axes (e.g. sequence parallelism after a
    # row-parallel layer): reduce-scatter into that dim instead of all-reduce then slice.
    want = spec_of(result_shape, mesh, where, block)
    out_dims = [*batch, m, n]
    scatter, scattered = [], set()
    for d in (nb, nb + 1):
        axes = tuple(x for x in mesh_axes(want[d]) if x in k and x not in scattered)
        if not axes or out_dims[d] or result_shape.shape[d] % math.prod(sizes[x] for x in axes):
            continue
        scatter.append((d, axes))
        scattered.update(axes)
        out_dims[d] = axes
    reduce = tuple(x for x in k if x not in scattered)

    def named(*entries):
        return NamedSharding(mesh, P(*(e if e else None for e in entries)))

    a_sh = named(*batch, k, m) if k_first[0] else named(*batch, m, k)
    b_sh = named(*batch, k, n) if k_first[1] else named(*batch, n, k)
    return Plan(
        k=k,
        reduce=reduce,
        scatter=tuple(scatter),
        arg_shardings=(a_sh, b_sh, a_sh, b_sh),
        result_sharding=named(*out_dims),
    )
