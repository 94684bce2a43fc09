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

import jax
import jax.numpy as jnp
from jax import lax
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
from jaxmx._src.core.dtypes import as_float_array, check_float_dtype, from_bits
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.materialize import tied
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.core.mxarray_layouts import along, swap_last_axes
from jaxmx._src.core.mxbits import MXBits, as_bits
from jaxmx._src.core.mxbits import from_bits as mx_from_bits
from jaxmx._src.core.recipes import MXFP8, Recipe, check_recipe
from jaxmx._src.quantize.hadamard import rht
from jaxmx._src.training import scope
from jaxmx._src.training.contract import (
    LHS_COLWISE,
    LHS_INPUT,
    RHS_COLWISE,
    RHS_INPUT,
    Dims,
    Operand,
    Static,
    canonical_operands,
    fprop,
    gemm,
    named,
    named_input,
    observed,
    observed_gradient,
    per_tensor,
    quantized,
    tiled,
    vma_like,
    weight_axes,
)
from jaxmx._src.training.higher_order import first_order_only


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
    dims = Dims.of(lhs.shape, rhs.shape, dimension_numbers)
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
    static = Static(
        recipe=recipe,
        out_dtype=out_dtype,
        lhs_dtype=lhs.dtype,
        rhs_dtype=rhs.dtype,
        training_problems=tuple(problems.values()),
        out_shape=dims.out_shape(lhs.shape, rhs.shape),
        n_batch=len(dims.lhs_batch),
        gemm_shape=dims.gemm_shape(lhs.shape, rhs.shape),
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


def _keeps_k_first(dims: Dims, rhs_ndim: int, r: Recipe) -> bool:
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


def _canonical_dot(static: Static, dims: Dims, lhs, rhs, key):
    """``lax.dot_general``'s result via the custom-VJP GEMM on ``[B, M, K]`` and ``[B, N, K]``
    (or ``[B, K, N]``, see :func:`_keeps_k_first`), its legs reported to the active observer
    (:func:`~jaxmx._src.training.scope.observe`)."""
    x, w = canonical_operands(dims, lhs, rhs, static.rhs_k_first)
    r = static.recipe
    lhs_leg = Operand(x=x, fmt=r.fwd, axis=-1)
    rhs_leg = Operand(x=w, fmt=r.fwd, axis=weight_axes(static)[0])
    static, tap = observed(static, lhs_leg, rhs_leg)
    return _mx_bmm(static, x, w, key, tap)


def _alignment_problems(lhs, rhs, dims: Dims, block: int) -> dict[str, str]:
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


def _explicit_layout(lhs, rhs, dims: Dims):
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


# --- the custom-VJP core on canonical operands x [B, M, K], w [B, N, K] or [B, K, N] --------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mx_bmm(static: Static, x, w, key, tap):
    """The GEMM, shaped as ``lax.dot_general``'s result (``static.out_shape``); ``tap``
    (``None``, or an observer's :class:`~jaxmx._src.training.scope.Tap` value) is unused here:
    its cotangent carries what the observer records of the backward."""
    y, _ = _forward(static, x, w, key, training=False)
    return y


def _mx_bmm_fwd(static: Static, x, w, key, tap):
    x, w = first_order_only(_WHERE, x, w)  # its residuals and y are not differentiable again
    return _forward(static, x, w, key, training=True)


def _forward(static: Static, x, w, key, training: bool):
    r = static.recipe
    if training:
        scope.require_gradient_key(r.grad_rounding, key)
    if training and static.training_problems:
        raise BlockShardingError(static.training_problems[0])
    along_k, along_n = weight_axes(static)
    col = dict(fmt=r.fwd, scale_mode=r.scale_mode, to_values=False)
    one_copy = training and r.residuals == "quantized" and per_tensor(r.fwd)
    if r.weight_tile:
        w_fwd = tiled(w, r.fwd, r)
    elif one_copy:  # one quantization serves every GEMM (see per_tensor)
        w_fwd = quantized(w, axis=along_k, **col)
    else:
        w_fwd = w
    x_fwd = quantized(x, axis=-1, **col) if one_copy and not r.rht else x
    y = fprop(static, x_fwd, _after_input(w_fwd, x) if r.weight_tile else w_fwd)
    if not training:
        return y, None
    if r.wgrad == "high_precision":
        x_saved = named_input(x, LHS_INPUT)
    elif r.residuals == "quantized":
        if isinstance(x_fwd, MXArray):
            x_col = along(x_fwd, x.ndim - 2)
        else:
            x_col = quantized(_wgrad_input(x, r), axis=-2, **col)
        x_saved = named(x_col, LHS_COLWISE)
    else:
        x_saved = named_input(x, LHS_INPUT)
    if r.residuals == "quantized":
        if r.weight_tile:
            w_col = w_fwd
        elif one_copy:
            w_col = along(w_fwd, w.ndim + along_n)
        else:
            w_col = quantized(w, axis=along_n, **col)
        w_saved = named(w_col, RHS_COLWISE)
    else:
        w_saved = named_input(w, RHS_INPUT)
    return y, ((x_saved, w_saved), key)


def _weight_layout(w_saved) -> jax.Array:
    """An array of the weight's (padded) shape laid out like the weight, whose sharding dw
    takes: the saved copy's codes (read from packed codes, whose block axis is shorter)."""
    if isinstance(w_saved, MXBits) and get_format(w_saved.fmt).packing:
        return mx_from_bits(w_saved).data
    return jax.tree.leaves(w_saved)[0]


def _mx_bmm_bwd(static: Static, residuals, g):
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
        along_n = weight_axes(static)[1]
        w_col = tiled(w, r.fwd, r) if r.weight_tile else Operand(x=w, fmt=r.fwd, axis=along_n)
    if r.wgrad == "high_precision":
        x_col = from_bits(x_saved, static.lhs_dtype)
    elif r.residuals == "quantized":
        x_col = mx_from_bits(_after(x_saved, g))
    else:
        x_col = Operand(x=_wgrad_input(from_bits(x_saved, static.lhs_dtype), r), fmt=r.fwd, axis=-2)
    if r.weight_tile:  # the forward's tiled weight [B, N, K], transposed: [B, K, N] along N
        w_col = swap_last_axes(w_col)
    row_key, col_key = scope.copy_keys(key)
    g_row = Operand(x=g, fmt=r.grad, axis=-1, key=row_key)  # [B, M, N] along N
    g_col = Operand(x=_wgrad_input(g, r), fmt=r.grad, axis=-2, key=col_key)  # along M
    g_dgrad, g_wgrad = _gradient_copies(r, g_row, g_col)
    dx = gemm(r, g_dgrad, w_col, static.lhs_dtype)  # [B, M, K], reduces N
    w_like = _weight_layout(w_saved)
    if r.wgrad == "high_precision":
        dw = _high_precision_wgrad(g, x_col, static)
    elif static.rhs_k_first:
        dw = gemm(r, x_col, g_wgrad, static.rhs_dtype, like=w_like)  # [B, K, N], reduces M
    else:
        dw = gemm(r, g_wgrad, x_col, static.rhs_dtype, like=w_like)  # [B, N, K], reduces M
    tap_ct = observed_gradient(static, g_row, g_col)
    return vma_like(dx, x_saved), vma_like(dw, w_saved), None, tap_ct


def _after(saved: MXBits, g) -> MXBits:
    """``saved`` unchanged, its scales :func:`~jaxmx._src.core.materialize.tied` to the
    output gradient ``g``, so that the scheduler decodes a residual in the backward pass where
    it is used, not as soon as its inputs exist (a weight's decode depends on the weight only
    and would otherwise run, and be held, from the start of the step)."""
    if g.size == 0:  # nothing to decode
        return saved
    scale = saved.scale
    unsigned = jnp.dtype(f"uint{8 * scale.dtype.itemsize}")
    s = tied(lax.bitcast_convert_type(scale, unsigned), to=g)
    return dataclasses.replace(saved, scale=lax.bitcast_convert_type(s, scale.dtype))


def _after_input(w: MXArray, x) -> MXArray:
    """The tiled weight ``w`` unchanged, its scales made to depend on the GEMM's input ``x``
    (:func:`_after`): its decode, which depends on the weight only, is scheduled where the
    forward GEMM reads it, not at the start of the step (where every layer's decoded weight
    was held at once)."""
    return mx_from_bits(_after(as_bits(w), x))


def _gradient_copies(r: Recipe, g_row: Operand, g_col: Operand):
    """The output gradient's operands of the dgrad and wgrad GEMMs: ``g_row`` and ``g_col``,
    each quantized where used, or for a per-tensor ``r.grad`` (without RHT, which transforms
    the wgrad copy) one quantization of ``g_row`` serving both (:func:`per_tensor`)."""
    if not per_tensor(r.grad) or r.rht:
        return g_row, g_col
    q = quantized(g_row.x, g_row.key, fmt=r.grad, axis=-1, scale_mode=r.scale_mode, to_values=False)
    return q, along(q, q.ndim - 2)


def _high_precision_wgrad(g, x, static: Static):
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


def _wgrad_input(x, r: Recipe):
    """An operand [B, M, *] of the weight-gradient GEMM, which reduces M: with ``r.rht``, its
    random Hadamard transform along M (the same for both operands, so the product is
    unchanged; M is zero-padded to a multiple of 16)."""
    if not r.rht:
        return x
    return rht(x, axis=-2, key=jax.random.key(r.rht_seed))


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
