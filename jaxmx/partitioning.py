"""SPMD support: MX blocks that follow shard boundaries, and the MX GEMM's partitioning rule.

Two pieces, both used under ``jax.jit`` with sharded arguments (see docs/distributed.md):

- :func:`check_block_alignment`: a reduction axis that is sharded must be split into whole MX
  blocks (a multiple of 32 elements per shard), or a quantization block would straddle two
  devices. ``jaxmx.dot_general`` calls it on every GEMM operand it quantizes, for the axis that GEMM
  reduces. The sharding XLA chose is read at compile time (``jax.debug.inspect_array_sharding``,
  which works for every backend and under ``vmap``, ``scan`` and remat), or at trace time when the
  mesh axes are ``Explicit``; a misaligned axis raises :class:`BlockShardingError`.
- :func:`partitioned_gemm`: wraps a per-shard GEMM (the native custom call of ``jaxmx.ffi``, or
  the emulation of ``jaxmx.matmul``) in ``jax.experimental.custom_partitioning`` with a Shardy
  sharding rule, so XLA partitions it instead of gathering its operands: rows M of the lhs, rows
  N of the rhs and the batch dims stay sharded, K is sharded together with its K/32 scale
  blocks, and a sharded K ends in a float32 ``psum`` (or a ``psum_scatter`` when the result is
  wanted sharded along the same mesh axes). The native GEMM swizzles the compact scales inside
  the per-shard function, i.e. per device and after any communication.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx.partitioning import BlockShardingError, check_block_alignment, dim
    >>> x = check_block_alignment(jnp.ones((4, 64)), "example()", "x", (dim(1, 64, "K"),))
    >>> issubclass(BlockShardingError, ValueError)
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmx.formats import BLOCK_SIZE

__all__ = [
    "BlockShardingError",
    "check_block_alignment",
    "dim",
    "partitioned_gemm",
    "vary_like",
    "varying_axes",
    "vmappable",
]


class BlockShardingError(ValueError):
    """A sharding splits an MX quantization block (32 elements along a reduction axis)."""


# --- block alignment checks -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Dim:
    axis: int
    size: int
    name: str  # short name of the axis, e.g. "K"
    role: str  # what the axis is, for the message
    fix: str  # an extra hint, appended to the message


def dim(axis: int, size: int, name: str, role: str = "", fix: str = "") -> _Dim:
    """A reduction axis to check: its index and size, a name, what it is, and a hint."""
    return _Dim(axis, size, name, role, fix)


@dataclasses.dataclass(frozen=True)
class _AlignmentCheck:
    """Callback for ``inspect_array_sharding`` (frozen: hashable and comparable by value)."""

    where: str
    tensor: str
    dims: tuple[_Dim, ...]
    offset: int = 0  # leading dims added by vmap

    def __call__(self, sharding) -> None:
        message = self.problem(sharding)
        if message is not None:
            raise BlockShardingError(message)

    def problem(self, sharding) -> str | None:
        for d in self.dims:
            axes, n = _shards(sharding, d.axis + self.offset)
            if n > 1 and d.size % (BLOCK_SIZE * n):
                return misaligned_message(self.where, self.tensor, d, axes, n)
        return None


def misaligned_message(where: str, tensor: str, d: _Dim, axes, n: int) -> str:
    """The text of a :class:`BlockShardingError`."""
    over = f"mesh axes {tuple(axes)}" if len(axes) != 1 else f"mesh axis {axes[0]!r}"
    per = f"{d.size / n:g}" if d.size % n else f"{d.size // n}"
    role = f"; {d.role}" if d.role else ""
    text = (
        f"{where}: {tensor} axis {d.name} (size {d.size}{role}) is sharded over {over} into "
        f"{n} shards of {per} elements, so MX quantization blocks ({BLOCK_SIZE} consecutive "
        "elements along a reduction axis) would straddle shard boundaries. Make the per-shard "
        f"size a multiple of {BLOCK_SIZE} ({d.name} a multiple of {BLOCK_SIZE} x {n} = "
        f"{BLOCK_SIZE * n}), shard this dimension over fewer devices, or leave it unsharded"
    )
    return text + (f" ({d.fix})." if d.fix else ".")


def check_block_alignment(x: jax.Array, where: str, tensor: str, dims) -> jax.Array:
    """Returns ``x`` unchanged; raises :class:`BlockShardingError` if a ``dims`` axis is misaligned.

    Args:
        x: the array about to be quantized along the axes in ``dims``.
        where, tensor: names for the message (the API called, and which operand ``x`` is).
        dims: :func:`dim` descriptions of the reduction axes of ``x`` to check.

    Under ``jit`` with ``Auto`` mesh axes the check runs when XLA has chosen the shardings, i.e.
    at compile time (the error then reaches the caller wrapped in a ``JaxRuntimeError`` whose
    text holds this message). With ``Explicit`` mesh axes (``jax.sharding.AxisType.Explicit``)
    the sharding is part of the type and the error is raised while tracing. Outside ``jit`` the
    array's own sharding is checked. Inside ``shard_map`` arrays are per-device blocks and
    nothing is sharded.
    """
    check = _AlignmentCheck(where, tensor, tuple(dims))
    sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
        check(sharding)  # Explicit axes: known while tracing (Auto axes show as unsharded here)
    return _guard(check)(x)


@functools.cache
def _guard(check: _AlignmentCheck):
    @jax.custom_batching.custom_vmap
    def guard(x):
        jax.debug.inspect_array_sharding(x, callback=check)
        return x

    @guard.def_vmap
    def rule(axis_size, in_batched, x):
        del axis_size
        if not in_batched[0]:
            return guard(x), False
        return _guard(dataclasses.replace(check, offset=check.offset + 1))(x), True

    return guard


def _shards(sharding, axis: int) -> tuple[tuple[str, ...], int]:
    """(mesh axis names, number of shards) of array axis ``axis`` under ``sharding``."""
    if isinstance(sharding, NamedSharding):
        spec = sharding.spec
        axes = _axes(spec[axis]) if axis < len(spec) else ()
        sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
        return axes, math.prod(sizes[a] for a in axes)
    hlo = getattr(sharding, "_hlo_sharding", None)  # a GSPMDSharding (no mesh to name axes)
    if hlo is None or hlo.is_replicated() or hlo.is_manual() or hlo.is_maximal():
        return (), 1
    tiles = hlo.tile_assignment_dimensions()
    return ("<unnamed>",), tiles[axis] if axis < len(tiles) else 1


def _axes(entry) -> tuple[str, ...]:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


# --- the GEMM's partitioning rule ---------------------------------------------------------------


# The Shardy sharding rule of the GEMM. Factors: batch dims (...), rows m of the lhs, rows n of the
# rhs, the reduction K of the codes (k) and of their K/32 scales (kb). The partition callback
# shards the scales exactly like their codes (K/n codes <-> K/32/n scale blocks). K and its blocks
# are not tied as the compound factor (kb 32): Shardy would then split a mesh axis that does not
# divide K/32 into sub-axes, which the partition callback cannot receive, and it could choose such
# a layout on its own; as separate factors a misaligned K reaches the callback, which raises
# BlockShardingError.
TN = ("mk", "nk")
"""Operand layouts: each operand's last two axes are (rows, K) -- "mk"/"nk", the TN form -- or
(K, rows) -- "km"/"kn", an operand quantized along its first axis and kept untransposed."""


def _gemm_rule(layout: tuple[str, str]) -> str:
    """The Shardy rule for operands in ``layout``, e.g. TN: ``... m k, ... n k, ... m kb, ...``."""
    a, b = (" ".join(side) for side in layout)
    a_scale, b_scale = (" ".join("kb" if c == "k" else c for c in side) for side in layout)
    return f"... {a}, ... {b}, ... {a_scale}, ... {b_scale} -> ... m n"


def _k_last(side: str) -> bool:
    return side[-1] == "k"


def partitioned_gemm(
    per_shard: Callable, out_dtype, where: str, layout: tuple[str, str] = TN
) -> Callable:
    """The GEMM ``per_shard(out_dtype)(a, b, a_scale, b_scale)``, partitioned by XLA (SPMD).

    Args:
        per_shard: ``per_shard(dtype)`` returns a function of ``a [..., M, K]``,
            ``b [..., N, K]`` and their compact scales ``[..., M, K/32]``, ``[..., N, K/32]``
            (or the K-first forms of ``layout``) that computes ``[..., M, N]`` in ``dtype``. It
            must be hashable (e.g. a cached module-level function).
        out_dtype: the result dtype.
        where: the API name used in error messages.
        layout: the operands' layouts, :data:`TN` or with "km" / "kn" for K-first operands.

    On one device ``per_shard`` runs as is. Under a multi-device ``jit``, XLA calls the partition
    rule with the shardings it propagated and ``per_shard`` runs on each device's blocks:
    a sharded K gives float32 partial products, summed by ``psum`` (or ``psum_scatter``) and
    rounded to ``out_dtype`` once. 8-bit codes and scales travel as ``uint8``, so gathers and
    other resharding move one byte per element on every platform.
    """
    out_dtype = jnp.dtype(out_dtype)

    def gemm(a, b, a_scale, b_scale):
        # Checked on the codes before the call as well: a misaligned K usually reaches the scales
        # split into mesh sub-axes, which the partition callback cannot be given.
        ka, kb = (
            x.ndim - 1 if _k_last(side) else x.ndim - 2
            for x, side in zip((a, b), layout, strict=True)
        )
        k = dim(ka, a.shape[ka], "K", "the contracting dimension")
        a = check_block_alignment(a, where, "the lhs", (k,))
        b = check_block_alignment(b, where, "the rhs", (dataclasses.replace(k, axis=kb),))
        args = (a, b, a_scale, b_scale)
        dtypes = tuple(jnp.dtype(x.dtype) for x in args)
        op = _partitioned(per_shard, out_dtype, dtypes, where, layout)
        return op(*(_to_bytes(x) for x in args))

    return gemm


@functools.cache
def _partitioned(per_shard: Callable, out_dtype, dtypes, where: str, layout: tuple[str, str]):
    def local(dtype, args):
        return per_shard(dtype)(*(_from_bytes(x, t) for x, t in zip(args, dtypes, strict=True)))

    @custom_partitioning
    def gemm(a, b, a_scale, b_scale):
        return local(out_dtype, (a, b, a_scale, b_scale))

    def partition(mesh, arg_shapes, result_shape):
        plan = _plan(mesh, arg_shapes, result_shape, where, layout)

        def lower(a, b, a_scale, b_scale):
            args = (a, b, a_scale, b_scale)
            if not plan.k:
                return local(out_dtype, args)
            # Partial sums leave the device in float32 and are rounded to out_dtype once.
            out = local(jnp.dtype(jnp.float32), args)
            for axis, axes in plan.scatter:
                out = lax.psum_scatter(out, axes, scatter_dimension=axis, tiled=True)
            if plan.reduce:
                out = lax.psum(out, plan.reduce)
            return out.astype(out_dtype)

        return mesh, lower, plan.result_sharding, plan.arg_shardings

    def infer(mesh, arg_shapes, result_shape):  # GSPMD propagation (Shardy uses the rule)
        return _plan(mesh, arg_shapes, result_shape, where, layout).result_sharding

    gemm.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_gemm_rule(layout),
        reduction_factors=("k", "kb"),
    )
    return gemm


_BYTE_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e8m0fnu))


def _to_bytes(x):
    return lax.bitcast_convert_type(x, jnp.uint8) if x.dtype in _BYTE_DTYPES else x


def _from_bytes(x, dtype):
    return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


@dataclasses.dataclass(frozen=True)
class _Plan:
    k: tuple[str, ...]  # mesh axes that split K
    reduce: tuple[str, ...]  # ... summed with psum
    scatter: tuple[tuple[int, tuple[str, ...]], ...]  # (output dim, axes) summed by psum_scatter
    arg_shardings: tuple[NamedSharding, ...]
    result_sharding: NamedSharding


def _plan(mesh, arg_shapes, result_shape, where: str, layout: tuple[str, str]) -> _Plan:
    """Consistent shardings for the four operands and the result, from the propagated ones.

    Each mesh axis is used once: batch dims first (from the lhs, else the rhs), then the lhs rows
    M, the rhs rows N (so a weight sharded like the activations' rows is gathered, FSDP style),
    then K (from the lhs, else the rhs). The scales follow their data.
    """
    a, b = arg_shapes[0], arg_shapes[1]
    nb = len(a.shape) - 2
    a_spec, b_spec = _spec_of(a), _spec_of(b)
    used: set[str] = set()

    def take(*entries):
        for entry in entries:
            axes = tuple(x for x in _axes(entry) if x not in used)
            if axes:
                used.update(axes)
                return axes
        return ()

    a_k, b_k = (nb + 1 if _k_last(side) else nb for side in layout)
    a_rows, b_rows = 2 * nb + 1 - a_k, 2 * nb + 1 - b_k
    batch = [take(a_spec[i], b_spec[i]) for i in range(nb)]
    m = take(a_spec[a_rows])
    n = take(b_spec[b_rows])
    k = take(a_spec[a_k], b_spec[b_k])
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    k_size, k_shards = a.shape[a_k], math.prod(sizes[x] for x in k)
    if k and k_size % (BLOCK_SIZE * k_shards):
        d = dim(a_k, k_size, "K", "the contracting dimension")
        raise BlockShardingError(misaligned_message(where, "the lhs", d, k, k_shards))

    # A result wanted sharded along K's mesh axes (e.g. sequence parallelism after a
    # row-parallel layer): reduce-scatter into that dim instead of all-reduce then slice.
    want = _spec_of(result_shape)
    out_dims = [*batch, m, n]
    scatter, scattered = [], set()
    for d in (nb, nb + 1):
        axes = tuple(x for x in _axes(want[d]) if x in k and x not in scattered)
        if not axes or out_dims[d] or result_shape.shape[d] % math.prod(sizes[x] for x in axes):
            continue
        scatter.append((d, axes))
        scattered.update(axes)
        out_dims[d] = axes
    reduce = tuple(x for x in k if x not in scattered)

    def named(*entries):
        return NamedSharding(mesh, P(*(e if e else None for e in entries)))

    a_sh = named(*batch, m, k) if _k_last(layout[0]) else named(*batch, k, m)
    b_sh = named(*batch, n, k) if _k_last(layout[1]) else named(*batch, k, n)
    return _Plan(
        k=k,
        reduce=reduce,
        scatter=tuple(scatter),
        arg_shardings=(a_sh, b_sh, a_sh, b_sh),
        result_sharding=named(*out_dims),
    )


def _spec_of(shape) -> tuple:
    sharding = getattr(shape, "sharding", None)
    ndim = len(shape.shape)
    if not isinstance(sharding, NamedSharding):
        return (None,) * ndim
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


# --- vmap --------------------------------------------------------------------------------------


def vmappable(impl: Callable, fold) -> Callable:
    """``impl(lhs, rhs, lhs_scale, rhs_scale)`` (equal leading batch dims) made vmappable.

    Under ``vmap`` the batch becomes a leading dim of one call (one custom call and workspace for
    the native GEMM), not a loop: when only the lhs (and, for ``fold``'s pattern, its scales) is
    batched and the rhs has no batch dims, the batch is folded into M (one bigger GEMM);
    otherwise unbatched operands are broadcast. (``custom_partitioning`` has no batching rule of
    its own, so the partitioned GEMM is wrapped in this.)
    """
    f = jax.custom_batching.custom_vmap(impl)

    @f.def_vmap
    def rule(axis_size, in_batched, lhs, rhs, lhs_scale, rhs_scale):
        args = (lhs, rhs, lhs_scale, rhs_scale)
        if tuple(in_batched) == fold and rhs.ndim == 2:
            m = lhs.shape[1]
            flat = [
                x.reshape(axis_size * m, *x.shape[2:]) if b else x
                for x, b in zip(args, fold, strict=True)
            ]
            out = f(*flat)
            return out.reshape(axis_size, m, out.shape[-1]), True
        args = [
            x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, b in zip(args, in_batched, strict=True)
        ]
        return f(*args), True

    return f


# --- shard_map ---------------------------------------------------------------------------------


def varying_axes(x) -> frozenset:
    """The ``shard_map`` mesh axes along which ``x`` varies (its "vma"; empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vary_like(out: jax.Array, *inputs: jax.Array) -> jax.Array:
    """``out`` marked as varying over every ``shard_map`` axis along which an input varies.

    A custom call's results carry no such marks, so without this a GEMM of per-device operands
    would look replicated, and autodiff would skip the sums its transpose needs.
    """
    want = frozenset().union(*(varying_axes(x) for x in inputs))
    missing = tuple(sorted(want - varying_axes(out)))
    return lax.pcast(out, missing, to="varying") if missing else out
