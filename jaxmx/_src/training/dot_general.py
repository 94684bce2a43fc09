"""``jaxmx.dot_general``: a drop-in for ``lax.dot_general`` that trains in MX formats.

Every GEMM runs on operands quantized along its own reduction axis (docs/training_gemm.md). With
``x [M, K]``, ``w [N, K]`` and the output gradient ``g [M, N]``:

========  ========  =========  ============================  ============================
GEMM      result    reduction  lhs operand                   rhs operand
========  ========  =========  ============================  ============================
fprop     y [M, N]  K          x rowwise [M, K] along K      w rowwise [N, K] along K
dgrad     dx [M, K] N          g rowwise [M, N] along N      w colwise [K, N] along N
wgrad     dw [N, K] M          g colwise [N, M] along M      x colwise [K, M] along M
========  ========  =========  ============================  ============================

Any ``dimension_numbers`` are reduced to this form by transposes and reshapes: batch dimensions
become a leading batch of independent GEMMs, several contracting dimensions merge into one K. A
weight stored with its contracting dimensions before its free ones (a Flax kernel ``[K, N]``) is
not transposed: each GEMM quantizes it along its own axis in place.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> x = jnp.ones((8, 64)); w = jnp.ones((16, 64))
    >>> y = jaxmx.dot_general(x, w, (((1,), (1,)), ((), ())))
    >>> y.shape, y[0, 0].item()
    ((8, 16), 64.0)
    >>> dw = jax.grad(lambda w: jaxmx.dot_general(x, w, (((1,), (1,)), ((), ()))).sum())(w)
    >>> dw[0, 0].item()
    8.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmx._src.core.block_sharding import (
    BlockShardingError,
    ReducedAxis,
    merged_axis_problem,
    named_sharding,
    shards,
)
from jaxmx._src.core.checks import check_key
from jaxmx._src.core.dtypes import as_float_array, check_float_dtype, from_bits, to_bits
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.mxarray import MXArray, MXBits, along, as_bits, swap_last_axes
from jaxmx._src.core.mxarray import from_bits as mx_from_bits
from jaxmx._src.core.recipes import MXFP8, Recipe, check_recipe
from jaxmx._src.core.vma import varying_axes
from jaxmx._src.gemm.dispatch import Gemm, kernels
from jaxmx._src.gemm.matmul import FORWARD_KERNELS, TRAINING_KERNELS
from jaxmx._src.quantize.fake import quantize_to_grid
from jaxmx._src.quantize.hadamard import rht
from jaxmx._src.quantize.quantize import quantize
from jaxmx._src.training import scope
from jaxmx._src.training.gathered import Quantized, gathered_gemm, quantized_inside
from jaxmx._src.training.higher_order import first_order_only
from jaxmx._src.training.local_quantize import local_quantize
from jaxmx._src.training.remat import opaque, presented_as_dot

LHS_COLWISE = "jaxmx_lhs_colwise"
RHS_COLWISE = "jaxmx_rhs_colwise"
LHS_INPUT = "jaxmx_lhs"
RHS_INPUT = "jaxmx_rhs"
"""``checkpoint_name`` s of the residuals (quantized default, then high precision), for remat
policies such as ``jax.checkpoint_policies.save_only_these_names(LHS_COLWISE, RHS_COLWISE)``."""


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    recipe: Recipe | None = MXFP8,
    key: jax.Array | None = None,
) -> jax.Array:
    """``lax.dot_general`` with MX-quantized forward, dgrad and wgrad GEMMs.

    Args:
        lhs, rhs: float32, bfloat16 or float16 arrays.
        dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`` as
            for ``lax.dot_general``.
        precision: accepted for signature compatibility and ignored: the recipe defines the
            precision of the products (exact MX products, float32 accumulation).
        preferred_element_type: the output dtype; default the promoted input dtype.
        recipe: a :class:`jaxmx.Recipe`, or ``None``: plain high precision (``lax.dot_general``
            with ``precision``; ``key`` ignored).
        key: a PRNG key for ``recipe.grad_rounding == "stochastic"`` (pass a fresh key each
            step, e.g. ``jax.random.fold_in(key, step)``), else taken from an enclosing
            :func:`jaxmx.stochastic_rounding` block; ignored with ``"nearest"``. The gradient's
            rowwise and columnwise copies use ``fold_in(key, 0)`` and ``fold_in(key, 1)``.

    Returns:
        An array shaped like ``lax.dot_general``'s result: batch dims, lhs free dims, rhs free dims.
    """
    check_recipe(recipe, "jaxmx.dot_general", optional=True)
    lhs = as_float_array(lhs, "jaxmx.dot_general: lhs")
    rhs = as_float_array(rhs, "jaxmx.dot_general: rhs")
    if recipe is None:  # plain high precision
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    if key is not None:
        key = check_key(key, "jaxmx.dot_general")
    key = scope.gradient_key(recipe.grad_rounding, key)
    dims = _Dims.of(lhs.shape, rhs.shape, dimension_numbers)
    out_dtype = check_float_dtype(
        preferred_element_type or jnp.result_type(lhs, rhs),
        "jaxmx.dot_general: preferred_element_type",
    )
    # Sharded reduction axes must be split into whole blocks: K for every call; M (reduced by
    # wgrad) and N (reduced by dgrad) only when a gradient is taken, so those wait for the VJP.
    problems = _alignment_problems(lhs, rhs, dims, get_format(recipe.fwd).block)
    if "K" in problems:
        raise BlockShardingError(problems["K"])
    if "N" in problems and recipe.weight_tile:  # the forward's weight tiles span N too
        raise BlockShardingError(problems["N"])
    static = _Static(
        recipe,
        out_dtype,
        lhs.dtype,
        rhs.dtype,
        tuple(problems.values()),
        dims.out_shape(lhs.shape, rhs.shape),
        len(dims.lhs_batch),
        dims.gemm_shape(lhs.shape, rhs.shape),
        rhs_k_first=_keeps_k_first(dims, rhs.ndim, recipe),
    )
    mesh, out_spec = _explicit_layout(lhs, rhs, dims)
    if mesh is None:
        return _canonical_dot(static, dims, lhs, rhs, key)
    # Explicit mesh axes: the canonicalising reshapes have no explicit output sharding, so the
    # GEMM runs with the mesh axes switched to Auto and gives its result the operands' layout.
    run = functools.partial(_canonical_dot, static, dims)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(run, out_sharding=out_spec)(lhs, rhs, key)


def _canonical_operands(dims: _Dims, lhs, rhs, rhs_k_first: bool = False):
    """``lhs`` as ``[B, M, K]`` and ``rhs`` as ``[B, N, K]`` (batch, free and contracting
    dimensions each merged into one), or with ``rhs_k_first`` as ``[B, K, N]`` (a reshape of
    ``rhs`` stored that way, see :func:`_keeps_k_first`)."""
    b = math.prod(lhs.shape[d] for d in dims.lhs_batch)
    m = math.prod(lhs.shape[d] for d in dims.lhs_free)
    n = math.prod(rhs.shape[d] for d in dims.rhs_free)
    k = math.prod(lhs.shape[d] for d in dims.lhs_contract)
    x = lhs.transpose(dims.lhs_batch + dims.lhs_free + dims.lhs_contract).reshape(b, m, k)
    if rhs_k_first:
        return x, rhs.reshape(b, k, n)
    return x, rhs.transpose(dims.rhs_batch + dims.rhs_free + dims.rhs_contract).reshape(b, n, k)


def _keeps_k_first(dims: _Dims, rhs_ndim: int, r: Recipe) -> bool:
    """Whether the GEMM takes ``rhs`` as ``[B, K, N]`` where it is stored that way (batch, then
    contracting, then free dimensions: e.g. a Flax kernel ``[in, out]``), instead of transposing
    it to ``[B, N, K]``.

    Each GEMM quantizes ``rhs`` along the axis it needs in place, so no copy reads it transposed
    (on XLA:CPU such fused strided reads cost about 5x a contiguous pass). Weight tiles keep
    ``[B, N, K]``: the tile layout is defined on it.
    """
    rows_first = dims.rhs_batch + dims.rhs_free + dims.rhs_contract
    k_first = dims.rhs_batch + dims.rhs_contract + dims.rhs_free
    identity = tuple(range(rhs_ndim))
    return rows_first != identity and k_first == identity and not r.weight_tile


def _canonical_dot(static: _Static, dims: _Dims, lhs, rhs, key):
    """``lax.dot_general``'s result via the custom-VJP GEMM on ``[B, M, K]`` and ``[B, N, K]``
    (or ``[B, K, N]``, see :func:`_keeps_k_first`), its legs reported to the active observer
    (:func:`~jaxmx._src.training.scope.observe`)."""
    x, w = _canonical_operands(dims, lhs, rhs, static.rhs_k_first)
    static, tap = _observed(static, x, w)
    return _mx_bmm(static, x, w, key, tap)


def _observed(static: _Static, x, w) -> tuple[_Static, object]:
    """Reports the forward GEMM's operands (``x`` along K, ``w`` along K where it lies) to the
    active observer: returns ``static`` carrying the observer's backward hook and the tap to pass
    to :func:`_mx_bmm`, or ``static`` and ``None`` when nothing observes the backward legs."""
    r = static.recipe
    lhs = scope.Leg(x, r.fwd, -1, r.scale_mode)
    rhs = scope.Leg(w, r.fwd, _weight_axes(static)[0], r.scale_mode)
    tap = scope.observe(r, lhs, rhs)
    if tap is None:
        return static, None
    return static._replace(observe_grad=tap.backward), tap.value


def _alignment_problems(lhs, rhs, dims: _Dims, block: int) -> dict[str, str]:
    """Messages for the canonical axes (K, M, N) whose sharding would split a block."""
    problems = {}
    for name, tensor, x, group in (
        ("K", "lhs", lhs, dims.lhs_contract),
        ("K", "rhs", rhs, dims.rhs_contract),
        ("M", "lhs", lhs, dims.lhs_free),
        ("N", "rhs", rhs, dims.rhs_free),
    ):
        axis = ReducedAxis(0, name, *_AXES[name])
        message = merged_axis_problem(
            named_sharding(x), x.shape, group, _WHERE, tensor, axis, block
        )
        if message and name not in problems:
            problems[name] = message
    return problems


def _explicit_layout(lhs, rhs, dims: _Dims):
    """(abstract mesh, output PartitionSpec) when an operand's type carries Explicit mesh axes,
    else (None, None). The output keeps each dim's sharding from its operand, each mesh axis
    used once (batch dims first, then the lhs free dims, then the rhs free dims)."""
    types = [jax.typeof(x).sharding for x in (lhs, rhs)]
    explicit = [
        s for s in types if isinstance(s, NamedSharding) and AxisType.Explicit in s.mesh.axis_types
    ]
    if not explicit:
        return None, None
    used: set[str] = set()

    def entry(sharding, axis):
        names = tuple(a for a in shards(sharding, axis)[0] if a not in used) if sharding else ()
        used.update(names)
        return names or None

    lhs_sh, rhs_sh = (
        s if isinstance(s, NamedSharding) and not s.mesh.empty else None for s in types
    )
    spec = [entry(lhs_sh, d) for d in dims.lhs_batch + dims.lhs_free]
    spec += [entry(rhs_sh, d) for d in dims.rhs_free]
    return explicit[0].mesh, P(*spec)


class _Static(NamedTuple):
    recipe: Recipe
    out_dtype: jnp.dtype
    lhs_dtype: jnp.dtype  # the gradients' dtypes
    rhs_dtype: jnp.dtype
    training_problems: tuple[str, ...]  # block misalignments that only a gradient runs into
    out_shape: tuple[int, ...]  # lax.dot_general's result: batch, lhs free, rhs free dims
    n_batch: int  # the number of batch dimensions of dimension_numbers
    gemm_shape: tuple[int, int, int]  # [B, M, N]: the canonical GEMM's result
    rhs_k_first: bool = False  # w is [B, K, N] instead of [B, N, K]
    observe_grad: Callable | None = None  # a scope.Tap's backward: (dgrad leg, wgrad leg) -> ct


class _Dims(NamedTuple):
    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    rhs_free: tuple[int, ...]

    @classmethod
    def of(cls, lhs_shape, rhs_shape, dimension_numbers) -> _Dims:
        try:
            (lc, rc), (lb, rb) = dimension_numbers
            lc, rc, lb, rb = (tuple(operator.index(d) for d in ds) for ds in (lc, rc, lb, rb))
        except (TypeError, ValueError):
            raise TypeError(
                "dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
            ) from None
        for side, shape, ds in (("lhs", lhs_shape, lc + lb), ("rhs", rhs_shape, rc + rb)):
            if any(not 0 <= d < len(shape) for d in ds) or len(set(ds)) != len(ds):
                raise ValueError(
                    f"dimension_numbers {dimension_numbers!r}: {side} dimensions {ds} must be "
                    f"distinct and within its rank {len(shape)}"
                )
        for kind, ls, rs in (("contracting", lc, rc), ("batch", lb, rb)):
            lsizes = tuple(lhs_shape[d] for d in ls)
            rsizes = tuple(rhs_shape[d] for d in rs)
            if lsizes != rsizes:
                raise ValueError(
                    f"jaxmx.dot_general: {kind} dimensions differ in size: lhs {ls} has "
                    f"{lsizes}, rhs {rs} has {rsizes}"
                )
        lf = tuple(d for d in range(len(lhs_shape)) if d not in lc + lb)
        rf = tuple(d for d in range(len(rhs_shape)) if d not in rc + rb)
        return cls(lc, rc, lb, rb, lf, rf)

    def out_shape(self, lhs_shape, rhs_shape) -> tuple[int, ...]:
        """``lax.dot_general``'s result shape: batch, lhs free, then rhs free dimensions."""
        lhs_dims = self.lhs_batch + self.lhs_free
        return tuple(lhs_shape[d] for d in lhs_dims) + tuple(rhs_shape[d] for d in self.rhs_free)

    def gemm_shape(self, lhs_shape, rhs_shape) -> tuple[int, int, int]:
        """[B, M, N]: the canonical GEMM's result (batch, free dimensions each merged)."""
        b = math.prod(lhs_shape[d] for d in self.lhs_batch)
        m = math.prod(lhs_shape[d] for d in self.lhs_free)
        return b, m, math.prod(rhs_shape[d] for d in self.rhs_free)


# --- the custom-VJP core on canonical operands x [B, M, K], w [B, N, K] or [B, K, N] --------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mx_bmm(static: _Static, x, w, key, tap):
    """The GEMM, shaped as ``lax.dot_general``'s result (``static.out_shape``); ``tap``
    (``None``, or an observer's :class:`~jaxmx._src.training.scope.Tap` value) is unused here:
    its cotangent carries what the observer records of the backward."""
    y, _ = _forward(static, x, w, key, training=False)
    return y


def _mx_bmm_fwd(static: _Static, x, w, key, tap):
    x, w = first_order_only(_WHERE, x, w)  # its residuals and y are not differentiable again
    return _forward(static, x, w, key, training=True)


def _forward(static: _Static, x, w, key, training: bool):
    r = static.recipe
    if training:
        scope.require_gradient_key(r.grad_rounding, key)
    if training and static.training_problems:
        raise BlockShardingError(static.training_problems[0])
    along_k, along_n = _weight_axes(static)
    col = dict(fmt=r.fwd, scale_mode=r.scale_mode, to_values=False)
    one_copy = training and r.residuals == "quantized" and _per_tensor(r.fwd)
    if r.weight_tile:
        w_fwd = _tiled(w, r.fwd, r)
    elif one_copy:  # one quantization serves every GEMM (see _per_tensor)
        w_fwd = _quantize(w, axis=along_k, **col)
    else:
        w_fwd = w
    x_fwd = _quantize(x, axis=-1, **col) if one_copy and not r.rht else x
    y = _fprop(static, x_fwd, w_fwd)
    if not training:
        return y, None
    if r.wgrad == "high_precision":
        x_saved = checkpoint_name(to_bits(x), LHS_INPUT)
    elif r.residuals == "quantized":
        if isinstance(x_fwd, MXArray):
            x_col = along(x_fwd, x.ndim - 2)
        else:
            x_col = _quantize(_wgrad_input(x, r), axis=-2, **col)
        x_saved = _named(x_col, LHS_COLWISE)
    else:
        x_saved = checkpoint_name(to_bits(x), LHS_INPUT)
    if r.residuals == "quantized":
        if r.weight_tile:
            w_col = w_fwd
        elif one_copy:
            w_col = along(w_fwd, w.ndim + along_n)
        else:
            w_col = _quantize(w, axis=along_n, **col)
        w_saved = _named(w_col, RHS_COLWISE)
    else:
        w_saved = checkpoint_name(to_bits(w), RHS_INPUT)
    return y, ((x_saved, w_saved), key)


def _per_tensor(fmt: str) -> bool:
    """Whether ``fmt`` has one scale per tensor: its quantization does not depend on the axis,
    so the forward GEMM's copy of an operand, relabelled (:func:`along`), is also its columnwise
    copy, and the output gradient's one copy serves both backward GEMMs."""
    return get_format(fmt).span == "tensor"


def _fprop(static: _Static, x, w):
    """The forward GEMM of ``x`` [B, M, K] and ``w`` (high precision, or the tiled weight) as
    remat policies see a stock ``lax.dot_general``: the kernels as one opaque equation (no inner
    dot of theirs is saved), the result ``static.out_shape`` through a dot with the stock
    GEMM's batch dimensions and output dtype (:mod:`jaxmx._src.training.remat`)."""
    r = static.recipe

    def gemm(x, w):
        along_k = _weight_axes(static)[0]
        rhs = w if isinstance(w, MXArray) else _Operand(w, r.fwd, along_k)
        lhs = x if isinstance(x, MXArray) else _Operand(x, r.fwd, -1)
        return _gemm(r, lhs, rhs, static.out_dtype, forward=True)

    y = opaque(gemm, x, w).reshape(static.out_shape)
    # The barrier keeps the reshape from [B, M, N] where it is: XLA's reshape mover would
    # otherwise sink it through the caller's elementwise chain one op per simplification pass
    # (a GELU's took the MXFP8 demo step's passes to XLA's limit of 25; docs/benchmarks.md).
    return lax.optimization_barrier(presented_as_dot(y, static.n_batch))


def _mx_bmm_bwd(static: _Static, residuals, g):
    r = static.recipe
    (x_saved, w_saved), key = residuals
    g = first_order_only(_WHERE, g)  # quantized below: its derivative would be zero
    # The output gradient of a loss such as `y.sum()` is a constant: without the barrier XLA
    # would evaluate its quantization while compiling, element by element (slow, and an alarm).
    g = lax.optimization_barrier(g.reshape(static.gemm_shape))
    if r.residuals == "quantized":
        w_col = mx_from_bits(_after(w_saved, g))
    else:
        w = from_bits(w_saved, static.rhs_dtype)
        along_n = _weight_axes(static)[1]
        w_col = _tiled(w, r.fwd, r) if r.weight_tile else _Operand(w, r.fwd, along_n)
    if r.wgrad == "high_precision":
        x_col = from_bits(x_saved, static.lhs_dtype)
    elif r.residuals == "quantized":
        x_col = mx_from_bits(_after(x_saved, g))
    else:
        x_col = _Operand(_wgrad_input(from_bits(x_saved, static.lhs_dtype), r), r.fwd, -2)
    if r.weight_tile:  # the forward's tiled weight [B, N, K], transposed: [B, K, N] along N
        w_col = swap_last_axes(w_col)
    row_key, col_key = scope.copy_keys(key)
    g_row = _Operand(g, r.grad, -1, row_key)  # [B, M, N] along N
    g_col = _Operand(_wgrad_input(g, r), r.grad, -2, col_key)  # along M
    g_dgrad, g_wgrad = _gradient_copies(r, g_row, g_col)
    dx = _gemm(r, g_dgrad, w_col, static.lhs_dtype)  # [B, M, K], reduces N
    w_like = jax.tree.leaves(w_saved)[0]  # laid out like the weight: dw's sharding
    if r.wgrad == "high_precision":
        dw = _high_precision_wgrad(g, x_col, static)
    elif static.rhs_k_first:
        dw = _gemm(r, x_col, g_wgrad, static.rhs_dtype, like=w_like)  # [B, K, N], reduces M
    else:
        dw = _gemm(r, g_wgrad, x_col, static.rhs_dtype, like=w_like)  # [B, N, K], reduces M
    tap_ct = _observed_gradient(static, g_row, g_col)
    return _vma_like(dx, x_saved), _vma_like(dw, w_saved), None, tap_ct


def _after(saved: MXBits, g) -> MXBits:
    """``saved`` unchanged, its scales made to depend on the output gradient ``g``
    (``min(s, s | b) == s`` for unsigned ``s``, ``b`` bits of one element of ``g``), so that
    the scheduler decodes a residual in the backward pass where it is used, not as soon as its
    inputs exist (a weight's decode depends on the weight only and would otherwise run, and be
    held, from the start of the step)."""
    scale = saved.scale
    if g.size == 0:  # nothing to decode
        return saved
    unsigned = jnp.dtype(f"uint{8 * scale.dtype.itemsize}")
    s = lax.bitcast_convert_type(scale, unsigned)
    bits = lax.bitcast_convert_type(g[(0,) * g.ndim].astype(jnp.float32), jnp.uint32)
    s = jnp.minimum(s, s | bits.astype(unsigned))
    return dataclasses.replace(saved, scale=lax.bitcast_convert_type(s, scale.dtype))


def _gradient_copies(r: Recipe, g_row: _Operand, g_col: _Operand):
    """The output gradient's operands of the dgrad and wgrad GEMMs: ``g_row`` and ``g_col``,
    each quantized where used, or for a per-tensor ``r.grad`` (without RHT, which transforms
    the wgrad copy) one quantization of ``g_row`` serving both (:func:`_per_tensor`)."""
    if not _per_tensor(r.grad) or r.rht:
        return g_row, g_col
    q = _quantize(g_row.x, g_row.key, fmt=r.grad, axis=-1, scale_mode=r.scale_mode, to_values=False)
    return q, along(q, q.ndim - 2)


def _high_precision_wgrad(g, x, static: _Static):
    """``Recipe.wgrad="high_precision"``: the weight gradient from the unquantized ``g [B, M, N]``
    and ``x [B, M, K]`` (float32 products and accumulation), ``[B, N, K]`` or, with
    ``rhs_k_first``, ``[B, K, N]``."""
    a, b = (x, g) if static.rhs_k_first else (g, x)
    dw = lax.dot_general(
        a,
        b,
        (((1,), (1,)), ((0,), (0,))),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return dw.astype(static.rhs_dtype)


def _observed_gradient(static: _Static, g_row: _Operand, g_col: _Operand):
    """The tap's cotangent: the observer's record of the two copies of the output gradient as
    the backward GEMMs quantize them (``None`` when nothing observes)."""
    if static.observe_grad is None:
        return None
    mode = static.recipe.scale_mode
    return static.observe_grad(
        scope.Leg(g_row.x, g_row.fmt, g_row.axis, mode),
        scope.Leg(g_col.x, g_col.fmt, g_col.axis, mode),
    )


def _weight_axes(static: _Static) -> tuple[int, int]:
    """The axes of the canonical weight along K and along N."""
    return (-2, -1) if static.rhs_k_first else (-1, -2)


def _wgrad_input(x, r: Recipe):
    """An operand [B, M, *] of the weight-gradient GEMM, which reduces M: with ``r.rht``, its
    random Hadamard transform along M (the same for both operands, so the product is
    unchanged; M is zero-padded to a multiple of 16)."""
    if not r.rht:
        return x
    return rht(x, axis=-2, key=jax.random.key(r.rht_seed))


def _vma_like(ct, primal):
    """``ct`` varying over the same ``shard_map`` axes as ``primal`` (what autodiff does itself).

    Inside ``shard_map``, the cotangent of an operand that is the same on every device (e.g.
    replicated weights in data parallelism) is summed over the axes along which the gradient
    varies; an operand that varies where the cotangent does not gets it broadcast (``pcast``).
    Outside ``shard_map`` both sets are empty.
    """
    want, have = varying_axes(jax.tree.leaves(primal)[0]), varying_axes(ct)
    extra = tuple(sorted(have - want))
    if extra:
        ct = lax.psum(ct, extra)
    missing = tuple(sorted(want - have))
    if missing:
        ct = lax.pcast(ct, missing, to="varying")
    return ct


_mx_bmm.defvjp(_mx_bmm_fwd, _mx_bmm_bwd)


_WHERE = "jaxmx.dot_general"
_AXES = {  # canonical axis -> (what it is, a hint), for BlockShardingError messages
    "K": ("the contracting dimension(s), reduced by the forward GEMM", ""),
    "M": (
        "the lhs free dimension(s) flattened, reduced by the weight-gradient GEMM",
        "e.g. a larger per-device batch or sequence",
    ),
    "N": ("the rhs free dimension(s) flattened, reduced by the input-gradient GEMM", ""),
}


class _Operand(NamedTuple):
    """A high-precision GEMM operand [B, rows, K] (``axis=-1``) or [B, K, rows] (``axis=-2``,
    a columnwise copy kept in place: the GEMM contracts it K-first), quantized where used."""

    x: jax.Array
    fmt: str
    axis: int
    key: jax.Array | None = None


def _gemm(
    r: Recipe,
    a: _Operand | MXArray,
    b: _Operand | MXArray,
    out_dtype,
    forward: bool = False,
    like=None,
) -> jax.Array:
    """The GEMM of two operands, each an MXArray (a residual, a tiled weight) or an
    :class:`_Operand`, on the kernels the dispatcher (:mod:`jaxmx._src.gemm.dispatch`) chooses.

    Where the emulation runs an MX GEMM in 1-D blocks with float32 accumulation
    (``"emulate_values"``), an ``_Operand`` is quantized straight to element values
    (:func:`~jaxmx._src.quantize.fake.quantize_to_grid`): it is quantized only to be decoded
    again, and skipping the codes gives the same result, bit for bit, in less time. Every other
    kernel takes MXArrays.

    ``forward``: the forward GEMM, whose native per-tensor / per-row FP8 GEMM runs with
    cuBLASLt's fast accumulation (:data:`~jaxmx._src.gemm.matmul.FORWARD_KERNELS`, as
    TransformerEngine does); the dgrad and wgrad GEMMs keep the split accumulator.

    ``like``: for the wgrad GEMM, an array laid out like the weight, from which a partitioned
    GEMM's result takes its sharding (:func:`~jaxmx._src.training.gathered.gathered_gemm`).
    """
    chosen = kernels(
        Gemm(
            formats=(a.fmt, b.fmt),
            tiles=(getattr(a, "tile", None), getattr(b, "tile", None)),
            backend=r.backend,
            accumulation=r.accumulation,
            scale_mode=r.scale_mode,
            to_values=True,
        )
    )

    def branch(kernel: str):
        def operand(q):
            if isinstance(q, MXArray):
                return q
            to_values = kernel == "emulate_values"
            return _quantize(
                q.x, q.key, fmt=q.fmt, axis=q.axis, scale_mode=r.scale_mode, to_values=to_values
            )

        run = (FORWARD_KERNELS if forward else TRAINING_KERNELS)[kernel]
        return lambda: run(operand(a), operand(b), out_dtype, r.accumulation)

    if len(chosen) == 1 and _gathers_8bit(chosen["default"]):
        return gathered_gemm(
            chosen["default"], _inside(r, a), _inside(r, b), out_dtype, forward, like
        )
    if len(chosen) == 1:
        return branch(chosen["default"])()
    return lax.platform_dependent(**{p: branch(kernel) for p, kernel in chosen.items()})


def _gathers_8bit(kernel: str) -> bool:
    """Whether the GEMM runs as :func:`~jaxmx._src.training.gathered.gathered_gemm`: an
    emulation outside ``shard_map`` (whose arrays are already per-device)."""
    return kernel in ("emulate", "emulate_values", "emulate_pow2_twin", "dequantized") and not (
        jax.sharding.get_abstract_mesh().manual_axes
    )


def _inside(r: Recipe, q: _Operand | MXArray):
    """An operand of :func:`gathered_gemm`: an MXArray as it is, an :class:`_Operand` as a
    :class:`Quantized` one where each shard can quantize its own part, else quantized here."""
    if isinstance(q, MXArray):
        return q
    if quantized_inside(q.fmt, q.key):
        return Quantized(q.x, q.fmt, q.x.ndim + q.axis, r.scale_mode)
    return _quantize(q.x, q.key, fmt=q.fmt, axis=q.axis, scale_mode=r.scale_mode, to_values=False)


# The quantizers are jitted so that eager (un-jitted) callers run one compiled kernel per copy;
# under an outer jit they inline. (Jitting _mx_bmm as a whole would hide the residual names from
# remat policies.)
@functools.partial(jax.jit, static_argnames=("fmt", "axis", "scale_mode", "to_values"))
def _quantize(x, key=None, *, fmt: str, axis: int, scale_mode: str, to_values: bool):
    """``x`` quantized along ``axis``: an MXArray, or with ``to_values`` a GridArray."""
    quantizer = quantize_to_grid if to_values else quantize
    return quantizer(x, fmt, axis=axis, scale_mode=scale_mode, key=key)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _tiled(w, fmt: str, r: Recipe) -> MXArray:
    """w [B, N, K] in ``r.weight_tile`` tiles: one copy for the forward and dgrad GEMMs, each
    device quantizing the tiles of its shard (:func:`local_quantize`)."""
    f = get_format(fmt)
    if f.span != "block" or jax.sharding.get_abstract_mesh().manual_axes:
        return quantize(w, fmt, axis=-1, scale_mode=r.scale_mode, tile=r.weight_tile)
    return local_quantize(w, fmt, r.scale_mode, r.weight_tile)


def _named(q: MXArray, name: str) -> MXBits:
    """``q`` as saved for the backward pass: its arrays as bits (:func:`as_bits`, so that
    ``lax.scan`` stacks them in place), named ``name`` for remat policies."""
    return jax.tree.map(lambda a: checkpoint_name(a, name), as_bits(q))
