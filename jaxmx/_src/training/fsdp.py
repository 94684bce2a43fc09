"""``jaxmx.fsdp_dot_general``: the MX training GEMM of a weight sharded over a ``shard_map`` axis.

Inside ``jax.shard_map`` a hand-written FSDP layer holds one shard of each weight (e.g. ``w``
``[N / n, K]``, its rows split over the axis ``"fsdp"``) and needs the GEMM with the whole
weight. :func:`fsdp_dot_general` quantizes the shard where it lives and all-gathers the 8-bit
codes and scales (as ``uint8``: XLA:CPU widens 8-bit floats on the wire), never the high
precision weight; the backward pass gathers the columnwise copy for the input gradient and
reduce-scatters the weight gradient back to the shard (``lax.psum_scatter``, in float32).

What each recipe gathers per step (codes 1 byte per element, scales 1/32 byte: 1.03 bytes per
element per plane for MXFP8):

=================  =============================================================================
recipe             gathers
=================  =============================================================================
1-D MX / block     the rowwise copy (forward) and the columnwise copy (backward): two planes
weight tiles       the one tiled plane, once: the forward's gathered copy serves the backward
per-tensor FP8     the one copy's codes in forward and again in backward; the amax is
                   ``lax.pmax``-ed over ``axis_name`` so every shard uses the global scale
=================  =============================================================================

The GEMMs are :func:`jaxmx.dot_general`'s (:mod:`jaxmx._src.training.contract`): the same
kernels and copies, so the loss and gradients equal the single-device :func:`jaxmx.dot_general`
step (the weight gradient to float32 rounding: the reduce-scatter adds the shards' partial
sums). Inside :func:`jaxmx.diagnostics.telemetry` (entered inside ``shard_map``) it records its
four legs as the tensors of all devices together, gathered over ``axis_name`` in high precision
for the observer only (default name ``fsdp_dot_general``): the single-device step's report.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import bits
from jaxmx._src.core.block_sharding import BlockShardingError
from jaxmx._src.core.dtypes import as_float_array, check_float_dtype
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.mxarray_layouts import along, swap_last_axes
from jaxmx._src.core.mxbits import from_bits as mx_from_bits
from jaxmx._src.core.recipes import MXFP8, Recipe, check_recipe
from jaxmx._src.core.reductions import max_along
from jaxmx._src.core.support import lacks
from jaxmx._src.core.vma import varying_axes
from jaxmx._src.gemm.gathered import all_gathered
from jaxmx._src.quantize.codec import encode
from jaxmx._src.quantize.scales import current_scale
from jaxmx._src.training import scope
from jaxmx._src.training.contract import (
    LHS_COLWISE,
    RHS_COLWISE,
    Dims,
    Operand,
    Static,
    canonical_operands,
    fprop,
    gemm,
    named,
    observed,
    observed_gradient,
    per_tensor,
    quantized,
    tiled,
    vma_like,
)
from jaxmx._src.training.higher_order import first_order_only

_WHERE = "jaxmx.fsdp_dot_general"


def fsdp_dot_general(
    lhs: jax.Array,
    rhs_shard: jax.Array,
    dimension_numbers,
    *,
    axis_name: str,
    gather_axis: int,
    recipe: Recipe = MXFP8,
    preferred_element_type=None,
) -> jax.Array:
    """``jaxmx.dot_general(lhs, all_gather(rhs_shard))`` inside ``jax.shard_map``, gathering
    the weight's 8-bit copies instead of the weight.

    Args:
        lhs: this device's activations (float32, bfloat16 or float16), e.g. ``x [M / n, K]``.
        rhs_shard: this device's shard of the weight, split over ``axis_name`` along
            ``gather_axis``, e.g. ``w [N / n, K]`` with ``gather_axis=0``, or a Flax kernel
            ``[K, N / n]`` with ``gather_axis=1``.
        dimension_numbers: as for ``lax.dot_general``, of ``lhs`` and the whole weight.
        axis_name: the ``shard_map`` mesh axis the weight is split over.
        gather_axis: the dimension of ``rhs_shard`` that is split: its first free (not
            contracting, not batch) dimension. Each shard must hold whole blocks along it
            (``BlockShardingError`` otherwise; per-tensor formats have no blocks).
        recipe: a :class:`jaxmx.Recipe` with 1-D blocks (MX, block FP8), weight tiles, or
            per-tensor FP8 scales, ``residuals="quantized"``, ``wgrad="quantized"``, rounding to
            nearest and no RHT (others are refused by name).
        preferred_element_type: the output dtype; default the promoted input dtype.

    Returns:
        ``lax.dot_general``'s result with the whole weight. The weight gradient is this shard's
        part of the sum over ``axis_name`` of the devices' gradients, reduce-scattered in
        float32 and then cast to ``rhs_shard.dtype``. Per-tensor scales (of ``lhs``, the weight
        and the output gradient) are the maxima over ``axis_name``, as one device computes them
        for the whole batch; scales are not reduced over other mesh axes.

    Example:
        >>> import jax, jax.numpy as jnp, jaxmx
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((1,), ("fsdp",))
        >>> def layer(x, w):
        ...     return jaxmx.fsdp_dot_general(x, w, (((1,), (1,)), ((), ())),
        ...                                   axis_name="fsdp", gather_axis=0)
        >>> f = jax.shard_map(layer, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")),
        ...                   out_specs=P("fsdp"))
        >>> x = w = jax.device_put(jnp.ones((32, 64)), jax.NamedSharding(mesh, P("fsdp")))
        >>> f(x, w)[0, 0].item()
        64.0
    """
    check_recipe(recipe, _WHERE)
    _check_recipe(recipe)
    lhs = as_float_array(lhs, f"{_WHERE}: lhs")
    rhs_shard = as_float_array(rhs_shard, f"{_WHERE}: rhs_shard")
    n_shards = lax.axis_size(axis_name)
    full = list(rhs_shard.shape)
    gather_axis = _checked_gather_axis(gather_axis, rhs_shard.ndim, dimension_numbers)
    full[gather_axis] *= n_shards
    dims = Dims.of(lhs.shape, tuple(full), dimension_numbers)
    if dims.rhs_free[0] != gather_axis:
        raise ValueError(
            f"{_WHERE}: gather_axis {gather_axis} must be the first free dimension of rhs "
            f"({dims.rhs_free[0]}), so that the gathered shards stay contiguous; transpose "
            "the weight so that its split dimension comes first"
        )
    out_dtype = check_float_dtype(
        preferred_element_type or jnp.result_type(lhs, rhs_shard),
        f"{_WHERE}: preferred_element_type",
    )
    static = Static(
        recipe=recipe,
        out_dtype=out_dtype,
        lhs_dtype=lhs.dtype,
        rhs_dtype=rhs_shard.dtype,
        out_shape=dims.out_shape(lhs.shape, full),
        n_batch=len(dims.lhs_batch),
        gemm_shape=dims.gemm_shape(lhs.shape, full),
    )
    x, w = canonical_operands(dims, lhs, rhs_shard)  # [B, M, K], [B, N / n, K]
    _check_blocks(recipe, w.shape[1], n_shards)
    static, tap = _observed(static, x, w, axis_name)
    return _fsdp_bmm(_Config(static, axis_name), x, w, tap)


class _Config(NamedTuple):
    static: Static  # the GEMM with the whole weight
    axis_name: str


def _observed(static: Static, x, w, axis_name: str) -> tuple[Static, object]:
    """Reports the forward legs to the active observer (under the name ``fsdp_dot_general``
    by default) as the tensors of all devices together: ``x`` [B, M, K] and the weight
    [B, N, K] along K, gathered over ``axis_name`` in high precision (only while observed)."""
    if scope.observer() is None:
        return static, None
    r = static.recipe
    lhs = Operand(x=_whole(x, axis_name), fmt=r.fwd, axis=-1)
    rhs = Operand(x=_whole(w, axis_name), fmt=r.fwd, axis=-1)
    return observed(static, lhs, rhs, "fsdp_dot_general")


def _whole(x, axis_name: str):
    """``x`` [B, rows / n, ...] of every device along ``axis_name`` as one [B, rows, ...],
    the same on every device (a high-precision all-gather, for the observer only)."""
    if axis_name not in varying_axes(x):
        x = lax.pcast(x, (axis_name,), to="varying")
    return lax.all_gather(x, axis_name, axis=1, tiled=True, to="invarying")


def _check_recipe(r: Recipe) -> None:
    for fmt in (r.fwd, r.grad):
        if missing := lacks(get_format(fmt), "fsdp"):
            raise ValueError(
                f"{_WHERE}: the format {fmt!r} has {missing}, which this helper does not "
                "reduce across shards; use 1-D "
                "block, tiled or per-tensor recipes, or jaxmx.dot_general under jax.jit with "
                "the weight's NamedSharding"
            )
    unsupported = {
        "residuals": (r.residuals, "quantized"),
        "wgrad": (r.wgrad, "quantized"),
        "grad_rounding": (r.grad_rounding, "nearest"),
        "rht": (r.rht, False),
    }
    for field, (value, want) in unsupported.items():
        if value != want:
            raise ValueError(
                f"{_WHERE}: recipe.{field}={value!r} is not supported (only {want!r}); use "
                "jaxmx.dot_general under jax.jit with the weight's NamedSharding"
            )


def _checked_gather_axis(gather_axis, ndim: int, dimension_numbers) -> int:
    if not isinstance(gather_axis, int) or not -ndim <= gather_axis < ndim:
        raise ValueError(
            f"{_WHERE}: gather_axis must be a dimension of rhs_shard, got {gather_axis!r}"
        )
    gather_axis %= ndim
    (_, rhs_contract), (_, rhs_batch) = dimension_numbers
    if gather_axis in tuple(rhs_contract):
        raise ValueError(
            f"{_WHERE}: gather_axis {gather_axis} is a contracting dimension of rhs: a weight "
            "split along K needs no gather (each device's GEMM reduces its part of K and a "
            "psum adds them: call jaxmx.dot_general on the shards of lhs and rhs and "
            "lax.psum the result over the axis); shard the weight along a free dimension "
            "(its output features) for FSDP"
        )
    if gather_axis in tuple(rhs_batch):
        raise ValueError(
            f"{_WHERE}: gather_axis {gather_axis} is a batch dimension of rhs: split lhs "
            "along the same batch dimension and call jaxmx.dot_general on the shards instead"
        )
    return gather_axis


def _check_blocks(r: Recipe, n_local: int, n_shards: int) -> None:
    """Each shard must hold whole blocks (or tiles) along N: the columnwise copy (and weight
    tiles) are quantized per shard."""
    f = get_format(r.fwd)
    if f.span == "tensor":
        return
    block = r.weight_tile[0] if r.weight_tile else f.block
    if n_local % block:
        raise BlockShardingError(
            f"{_WHERE}: each shard holds {n_local} rows of the weight along its gathered (free) "
            f"dimension, not a multiple of the {r.fwd} block of {block}: its columnwise copy "
            f"would split a block between shards. Fix: make the weight's free size a multiple "
            f"of {block * n_shards} ({block} per shard on {n_shards} shards), e.g. by padding "
            "it, or shard it over fewer devices"
        )


# --- the custom VJP on canonical operands x [B, M, K] and w [B, N / n, K] ---------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fsdp_bmm(config: _Config, x, w, tap):
    """The GEMM; ``tap`` (``None``, or an observer's tap value) is unused here: its cotangent
    carries what the observer records of the backward pass."""
    return _forward(config, x, w)[0]


def _forward(config: _Config, x, w):
    static, name = config
    r = static.recipe
    col = dict(fmt=r.fwd, scale_mode=r.scale_mode, to_values=False)
    if per_tensor(r.fwd):  # one copy of each operand, with the global scale
        w_row = _current_copy(w, r.fwd, r.scale_mode, name, axis=2)
        x_fwd = _current_copy(x, r.fwd, r.scale_mode, name, axis=2)
        w_saved, x_col = along(w_row, 1), along(x_fwd, 1)
    else:
        w_row = tiled(w, r.fwd, r) if r.weight_tile else quantized(w, axis=-1, **col)
        x_fwd = x
        x_col = quantized(x, axis=-2, **col)
    w_full = _gathered(w_row, name)
    y = fprop(static, x_fwd, w_full)
    if r.weight_tile:  # the gathered plane serves dgrad too
        w_saved = w_full
    elif not per_tensor(r.fwd):
        w_saved = quantized(w, axis=-2, **col)  # this shard's columnwise copy, along N
    return y, (named(x_col, LHS_COLWISE), named(w_saved, RHS_COLWISE))


def _fwd(config: _Config, x, w, tap):
    x, w = first_order_only(_WHERE, x, w)
    return _forward(config, x, w)


def _bwd(config: _Config, residuals, g):
    static, name = config
    r = static.recipe
    x_saved, w_saved = residuals
    g = first_order_only(_WHERE, g).reshape(static.gemm_shape)
    x_col, w_col = mx_from_bits(x_saved), mx_from_bits(w_saved)
    if r.weight_tile:  # the gathered tiles [B, N, K], transposed: [B, K, N] along N
        w_col = swap_last_axes(w_col)
    else:
        w_col = _gathered(w_col, name)
    if per_tensor(r.grad):
        g_dgrad = _current_copy(g, r.grad, r.scale_mode, name, axis=2)
        g_wgrad = along(g_dgrad, 1)
    else:
        g_dgrad, g_wgrad = Operand(x=g, fmt=r.grad, axis=-1), Operand(x=g, fmt=r.grad, axis=-2)
    dx = gemm(r, g_dgrad, w_col, static.lhs_dtype)  # [B, M, K], reduces N
    dw = gemm(r, g_wgrad, x_col, jnp.float32)  # [B, N, K], this device's part of the sum
    dw = lax.psum_scatter(dw, name, scatter_dimension=1, tiled=True).astype(static.rhs_dtype)
    tap_ct = None
    if static.observe_grad is not None:  # g of every device: along N (dgrad), along M (wgrad)
        whole = _whole(g, name)
        dgrad, wgrad = Operand(x=whole, fmt=r.grad, axis=-1), Operand(x=whole, fmt=r.grad, axis=-2)
        tap_ct = observed_gradient(static, dgrad, wgrad)
    return vma_like(dx, x_saved), vma_like(dw, w_saved), tap_ct


_fsdp_bmm.defvjp(_fwd, _bwd)


def _current_copy(x, fmt: str, scale_mode: str, axis_name: str, *, axis: int) -> MXArray:
    """``x`` quantized with one scale per tensor, from its amax maximised over ``axis_name``
    (where ``x`` varies over it): every shard's codes use the scale of the whole tensor."""
    f = get_format(fmt)
    x32 = bits.upcast_exact(x)
    amax_bits = max_along(bits.to_bits(x32) & 0x7FFFFFFF)
    if axis_name in varying_axes(x):
        amax_bits = lax.pmax(amax_bits, axis_name)
    scale = current_scale(amax_bits, f, scale_mode)
    data = encode(jnp.clip(x32 * scale, -f.elem_max, f.elem_max), f)
    return MXArray(data, scale.reshape((1,) * x.ndim), f.name, axis, tuple(x.shape))


def _gathered(q: MXArray, axis_name: str) -> MXArray:
    """The MXArray of the whole weight from this shard's ``q`` [B, N / n, K] (blocks along K
    or N, or tiles): codes and scales all-gathered along N as bytes. A per-tensor scale is the
    same on every shard and is not gathered."""

    n = lax.axis_size(axis_name)
    scale = q.scale if per_tensor(q.fmt) else all_gathered(q.scale, axis_name, 1)
    shape = (q.shape[0], q.shape[1] * n, *q.shape[2:])
    return MXArray(
        all_gathered(q.data, axis_name, 1), scale, q.fmt, q.axis, shape, q.tile, q.global_scale
    )
