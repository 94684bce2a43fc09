"""``jaxmx.ragged_dot``: the grouped GEMM of mixture-of-experts layers, in MX formats.

The semantics of ``jax.lax.ragged_dot``: ``lhs [m, k]`` holds the tokens of ``g`` groups one
after the other (``group_sizes [g]``; rows past their sum give zeros), ``rhs [g, k, n]`` one
matrix per group, and row ``i`` of the result is ``lhs[i] @ rhs[group(i)]``. A custom VJP runs
the three GEMMs on operands quantized along their own reduction axes:

=========  ==============  ==================  ===================================
GEMM       result          reduction           operands
=========  ==============  ==================  ===================================
forward    out [m, n]      K                   lhs along K, rhs along K
dgrad      dlhs [m, k]     N                   the output gradient along N, rhs along N
wgrad      drhs [g, k, n]  each group's tokens lhs and the output gradient along M
=========  ==============  ==================  ===================================

For the weight gradient each group's tokens are laid out from a multiple of the block (32 for
MX formats) and zero-padded to whole blocks (a static bound of ``m + 31 g`` rows, so group sizes
may be traced), so a block never mixes two groups whatever the group sizes. The GEMMs are
emulated (exact decode, float32 accumulation): there is no native grouped GEMM yet.

Weight tiles and the Hadamard transform hold exactly in a grouped GEMM, so every preset runs
as it is (:func:`grouped_recipe` returns the recipe that runs): ``Recipe.weight_tile`` tiles
each expert's ``[k, n]`` matrix (a tile never spans two experts),
and one tiled quantization of ``rhs`` serves the forward and dgrad GEMMs; ``Recipe.rht``
transforms the two wgrad operands along the tokens of the layout above, whose groups start at
multiples of the transform's 16 rows, so each 16x16 Hadamard block lies within one group and
each group's product is unchanged in exact arithmetic. An NVFP4 tensor scale is one per operand
(over all groups' tokens, over all experts' weights).

The contract of :func:`jaxmx.dot_general` holds: ``Recipe.residuals="quantized"`` saves the two
8-bit columnwise copies (``lhs`` laid out by group along its tokens, named
:data:`jaxmx.LHS_COLWISE`; ``rhs`` along N, or its one tiled copy, :data:`jaxmx.RHS_COLWISE`),
``"high_precision"`` saves the inputs (:data:`jaxmx.LHS_INPUT`, :data:`jaxmx.RHS_INPUT`) and
quantizes them in the backward pass; inside :func:`jaxmx.diagnostics.telemetry` it records its
four legs (default name ``ragged_dot``). ``Recipe.accum_bits`` (and so ``promote_every``) and
the native and ``lax.scaled_dot`` backends are refused by name. ``jax.vmap`` may map any of the
operands (``lax.ragged_dot``'s own batching rule takes only all three mapped); forward-mode
differentiation (``jax.jvp``, ``jax.jacfwd``) is JAX's refusal for custom-VJP functions, as for
:func:`jaxmx.dot_general`.

``lhs`` may also come already quantized: an :class:`jaxmx.MXArray` ``[m, k]`` in ``recipe.fwd``
blocked along K (tokens received in 8 bits, :func:`jaxmx.expert_parallel_ffn`). Its codes feed
the forward GEMM as they are (no decode and requantization: the same numbers as the high-precision
``lhs`` it was quantized from with ``recipe.scale_mode``), and the weight gradient's columnwise
copy is quantized from its decoded values, as DeepSeek-V3 requantizes its FP8 activations for the
backward pass (the one difference from the high-precision ``lhs``: the wgrad operand is quantized
twice). An MXArray is data: it gets no gradient.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> lhs, rhs = jnp.ones((6, 64)), jnp.stack([jnp.ones((64, 8)), 2 * jnp.ones((64, 8))])
    >>> jaxmx.ragged_dot(lhs, rhs, jnp.array([2, 4]))[:, 0].tolist()
    [64.0, 64.0, 128.0, 128.0, 128.0, 128.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmx._src.core.checks import check_key
from jaxmx._src.core.dtypes import as_array, as_float_array, check_float_dtype, from_bits
from jaxmx._src.core.formats import get_format
from jaxmx._src.core.mxarray import MXArray, checked
from jaxmx._src.core.mxbits import MXBits, as_bits
from jaxmx._src.core.mxbits import from_bits as mx_from_bits
from jaxmx._src.core.recipes import MXFP8, Recipe, check_recipe
from jaxmx._src.quantize.fake import fake_quantize
from jaxmx._src.quantize.hadamard import rht
from jaxmx._src.quantize.quantize import dequantize, quantize
from jaxmx._src.training import scope
from jaxmx._src.training.contract import (
    LHS_COLWISE,
    LHS_INPUT,
    RHS_COLWISE,
    RHS_INPUT,
    Operand,
    Static,
    named,
    named_input,
    observed,
    observed_gradient,
    vma_like,
)
from jaxmx._src.training.grouped import (
    BY_ROWS,
    BY_TOKENS,
    check_group_sizes,
    group_padded,
    grouped_recipe,
)
from jaxmx._src.training.higher_order import first_order_only


def ragged_dot(
    lhs: jax.Array | MXArray,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    recipe: Recipe | None = MXFP8,
    key: jax.Array | None = None,
) -> jax.Array:
    """``jax.lax.ragged_dot`` with MX-quantized forward, dgrad and wgrad GEMMs.

    Args:
        lhs: ``[m, k]`` float32, bfloat16 or float16, the groups' rows one after the other; or
            an :class:`jaxmx.MXArray` ``[m, k]`` of ``recipe.fwd`` blocked along K, quantized
            with ``recipe.scale_mode`` (an MXArray does not record it), which counts as float32
            for the default output dtype (see the module docstring).
        rhs: ``[g, k, n]``, one matrix per group.
        group_sizes: ``[g]`` non-negative integers (may be traced: then unchecked), summing to
            at most ``m``.
        preferred_element_type: the output dtype; default the promoted input dtype.
        recipe: a :class:`jaxmx.Recipe` without ``accum_bits`` whose backend has a grouped
            form (``"auto"`` or the emulation), run as :func:`grouped_recipe` says; or
            ``None``: plain high precision (``lax.ragged_dot``, ``key`` ignored).
        key: for ``recipe.grad_rounding == "stochastic"``, as in :func:`jaxmx.dot_general`.

    Returns:
        ``[m, n]``: row ``i`` is ``lhs[i] @ rhs[group(i)]``, zero past the last group.
    """
    if check_recipe(recipe, "jaxmx.ragged_dot", optional=True) is not None:
        recipe = grouped_recipe(recipe)
    if isinstance(lhs, MXArray):
        carrier = jnp.zeros(lhs.shape, jnp.float32)  # its gradient is dropped
        return quantized_ragged_dot(
            lhs,
            carrier,
            rhs,
            group_sizes,
            preferred_element_type=preferred_element_type,
            recipe=recipe,
            key=key,
        )
    lhs = as_float_array(lhs, "jaxmx.ragged_dot: lhs")
    rhs, group_sizes, out_dtype = _checked_operands(lhs, rhs, group_sizes, preferred_element_type)
    if recipe is None:  # plain high precision
        return lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    return _run(recipe, lhs, lhs, rhs, group_sizes, out_dtype, key)


def quantized_ragged_dot(
    lhs: MXArray,
    carrier: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    recipe: Recipe = MXFP8,
    key: jax.Array | None = None,
) -> jax.Array:
    """:func:`ragged_dot` of an already quantized ``lhs`` (an MXArray ``[m, k]`` of
    ``recipe.fwd`` blocked along K), whose input gradient is the gradient of ``carrier``: an
    ``[m, k]`` float array whose values are not read (zeros, typically), there to carry the
    gradient back to what ``lhs`` was quantized from (the dispatch of
    :func:`jaxmx.expert_parallel_ffn`). ``carrier``'s dtype is the default output dtype with
    ``rhs``'s, and the gradient's dtype.

    Example:
        >>> import jax, jax.numpy as jnp, jaxmx
        >>> x, w = jnp.ones((4, 32)), jnp.ones((2, 32, 8))
        >>> f = lambda c, w: quantized_ragged_dot(jaxmx.quantize(x), c, w, jnp.array([1, 3])).sum()
        >>> jax.grad(f)(jnp.zeros((4, 32)), w)[0, 0].item()  # the sum over n of w
        8.0
    """
    where = "jaxmx.ragged_dot"
    if check_recipe(recipe, where) is not None:
        recipe = grouped_recipe(recipe)
    lhs = checked(lhs, f"{where}: lhs")
    carrier = as_float_array(carrier, f"{where}: carrier")
    if lhs.fmt != recipe.fwd or lhs.axis != 1 or len(lhs.shape) != 2:
        raise ValueError(
            f"{where}: an MXArray lhs must be [m, k] in the recipe's forward format "
            f"{recipe.fwd!r} blocked along K (axis 1), got {lhs.fmt!r} {list(lhs.shape)} "
            f"blocked along axis {lhs.axis}"
        )
    if lhs.tile is not None or lhs.global_scale is not None:
        raise ValueError(
            f"{where}: an MXArray lhs must have 1-D blocks and no tensor scale, got tile "
            f"{lhs.tile} and global_scale {lhs.global_scale is not None}"
        )
    if carrier.shape != lhs.shape:
        raise ValueError(
            f"{where}: carrier must have lhs's shape {list(lhs.shape)}, got {list(carrier.shape)}"
        )
    rhs, group_sizes, out_dtype = _checked_operands(
        carrier, rhs, group_sizes, preferred_element_type
    )
    return _run(
        recipe, _Quantized(as_bits(lhs), carrier), carrier, rhs, group_sizes, out_dtype, key
    )


class _Quantized(NamedTuple):
    """An already quantized ``lhs``: its bits, and the array that takes its gradient."""

    bits: object  # MXBits
    carrier: jax.Array


def _checked_operands(lhs, rhs, group_sizes, preferred_element_type):
    """(``rhs``, ``group_sizes``, the output dtype) after the shape and dtype checks."""
    rhs = as_float_array(rhs, "jaxmx.ragged_dot: rhs")
    group_sizes = as_array(group_sizes, "jaxmx.ragged_dot: group_sizes")
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            "jaxmx.ragged_dot: lhs must be [m, k] and rhs [g, k, n] with the same k, got lhs "
            f"{lhs.shape} and rhs {rhs.shape}"
        )
    if group_sizes.shape != rhs.shape[:1] or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"jaxmx.ragged_dot: group_sizes must be [g] = [{rhs.shape[0]}] integers, got "
            f"{group_sizes.dtype}{list(group_sizes.shape)}"
        )
    out_dtype = check_float_dtype(
        preferred_element_type or jnp.result_type(lhs, rhs),
        "jaxmx.ragged_dot: preferred_element_type",
    )
    check_group_sizes(group_sizes)
    return rhs, group_sizes, out_dtype


def _run(recipe: Recipe, lhs, lhs_like, rhs, group_sizes, out_dtype, key):
    """The quantized grouped GEMM of ``lhs`` (an array or :class:`_Quantized`); ``lhs_like``:
    the high-precision array that stands for it (its dtype is the gradient's)."""
    if key is not None:
        key = check_key(key, "jaxmx.ragged_dot")
    key = scope.gradient_key(recipe.grad_rounding, key)
    static = _Grouped(
        recipe=recipe, out_dtype=out_dtype, lhs_dtype=lhs_like.dtype, rhs_dtype=rhs.dtype
    )
    if isinstance(lhs, _Quantized):
        static = dataclasses.replace(static, quantized_lhs=jax.tree.map(_shape_of, lhs.bits))
    static, tap = observed(  # both along K, under the name ragged_dot by default
        static,
        Operand(x=_values(lhs), fmt=recipe.fwd, axis=1),
        Operand(x=rhs, fmt=recipe.fwd, axis=1),
        "ragged_dot",
    )
    return _ragged(static, lhs, rhs, group_sizes.astype(jnp.int32), key, tap)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Grouped(Static):
    """The grouped GEMM's :class:`Static`: with an already quantized lhs, its bits as
    ``ShapeDtypeStruct`` s (static), whose cotangent the backward pass builds."""

    quantized_lhs: object = None


def _decoded(x, fmt: str, r: Recipe, axis: int, key=None) -> jax.Array:
    """``x`` quantized along ``axis`` and decoded to float32, exactly (without the codes)."""
    return fake_quantize(x, fmt, axis=axis, scale_mode=r.scale_mode, key=key)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged(static: _Grouped, lhs, rhs, group_sizes, key, tap):
    """The grouped GEMM; ``tap`` (``None`` or an observer's tap) is unused here: its cotangent
    carries what the observer records of the backward pass."""
    return _forward(static, lhs, rhs, group_sizes, _tiled(static.recipe, rhs))


def _forward(static: _Grouped, lhs, rhs, group_sizes, tiled: MXArray | None):
    """The forward GEMM; ``rhs`` is read along K, or as ``tiled`` (:func:`_tiled`)."""
    r = static.recipe
    rhs = _decoded(rhs, r.fwd, r, axis=1) if tiled is None else dequantize(tiled)
    if isinstance(lhs, _Quantized):  # its codes as they are
        lhs = dequantize(mx_from_bits(lhs.bits))
    else:
        lhs = _decoded(lhs, r.fwd, r, axis=1)
    y = BY_ROWS(lhs, rhs, group_sizes)
    return y.astype(static.out_dtype)


def _values(lhs) -> jax.Array:
    """The high-precision ``lhs``, or the float32 values of a :class:`_Quantized` one."""
    return dequantize(mx_from_bits(lhs.bits)) if isinstance(lhs, _Quantized) else lhs


def _tiled(r: Recipe, rhs) -> MXArray | None:
    """With ``r.weight_tile``, ``rhs [g, k, n]`` in those tiles of each expert's ``[k, n]``
    matrix: one quantization for the forward and dgrad GEMMs (a tile holds the same bytes
    transposed); else ``None``."""
    if not r.weight_tile:
        return None
    return quantize(rhs, r.fwd, axis=-1, scale_mode=r.scale_mode, tile=r.weight_tile)


def _ragged_fwd(static: _Grouped, lhs, rhs, group_sizes, key, tap):
    r = static.recipe
    scope.require_gradient_key(r.grad_rounding, key)
    rhs = first_order_only(_WHERE, rhs)  # the residuals and y: not differentiable again
    if not isinstance(lhs, _Quantized):
        lhs = first_order_only(_WHERE, lhs)
    tiled = _tiled(r, rhs)
    y = _forward(static, lhs, rhs, group_sizes, tiled)
    if r.residuals == "quantized":  # the 8-bit copies the two backward GEMMs read
        lhs_col, rhs_by_n = _columnwise(r, _values(lhs), rhs, group_sizes, tiled)
        saved = (named(lhs_col, LHS_COLWISE), named(rhs_by_n, RHS_COLWISE))
    elif isinstance(lhs, _Quantized):  # the input is the codes
        saved = (
            named(mx_from_bits(lhs.bits), LHS_INPUT),
            named_input(rhs, RHS_INPUT),
        )
    else:
        saved = (named_input(lhs, LHS_INPUT), named_input(rhs, RHS_INPUT))
    return y, (saved, group_sizes, key)


def _columnwise(r: Recipe, lhs, rhs, group_sizes, tiled: MXArray | None):
    """The backward GEMMs' copies of the inputs, both MXArrays: ``lhs`` laid out by group
    (:func:`_by_group`) and quantized along each group's tokens, for the weight gradient, and
    ``rhs`` for the input gradient: along N, or the forward's ``tiled`` copy."""
    lhs_by_group, _ = _by_group(lhs, group_sizes, r)
    rhs_by_n = quantize(rhs, r.fwd, axis=2, scale_mode=r.scale_mode) if tiled is None else tiled
    return quantize(lhs_by_group, r.fwd, axis=0, scale_mode=r.scale_mode), rhs_by_n


def _by_group(x, group_sizes, r: Recipe):
    """(``x [m, c]`` laid out by group as the weight-gradient GEMM reads it, and the padded group
    sizes): :func:`group_padded` to whole blocks of both formats, then with ``r.rht`` the random
    Hadamard transform along the tokens. Groups start at multiples of its 16 rows, so no 16x16
    block mixes two groups and each group's product is unchanged in exact arithmetic."""
    block = math.lcm(get_format(r.fwd).block, get_format(r.grad).block)
    if r.rht:
        block = math.lcm(block, _RHT_ROWS)
    x, padded_sizes = group_padded(x, group_sizes, block)
    if r.rht:
        x = rht(x, axis=0, key=jax.random.key(r.rht_seed), size=_RHT_ROWS)
    return x, padded_sizes


def _ragged_bwd(static: _Grouped, residuals, g):
    r = static.recipe
    saved, group_sizes, key = residuals
    g = first_order_only(_WHERE, g)  # quantized below: its derivative would be zero
    if r.residuals == "quantized":
        lhs_col, rhs_by_n = (mx_from_bits(q) for q in saved)
    else:
        lhs = (
            dequantize(mx_from_bits(saved[0]))
            if isinstance(saved[0], MXBits)
            else from_bits(saved[0], static.lhs_dtype)
        )
        rhs = from_bits(saved[1], static.rhs_dtype)
        lhs_col, rhs_by_n = _columnwise(r, lhs, rhs, group_sizes, _tiled(r, rhs))
    row_key, col_key = scope.copy_keys(key)
    dlhs = BY_ROWS(  # reduces N
        _decoded(g, r.grad, r, axis=1, key=row_key),
        dequantize(rhs_by_n).swapaxes(1, 2),
        group_sizes,
    )
    g_by_group, padded_sizes = _by_group(g, group_sizes, r)
    drhs = BY_TOKENS(  # reduces each group's tokens: [g, k, n]
        dequantize(lhs_col).T,
        _decoded(g_by_group, r.grad, r, axis=0, key=col_key),
        padded_sizes,
    )
    # the output gradient as the dgrad GEMM quantizes it (g [m, n] along N) and as the wgrad
    # GEMM does (laid out by group and transformed, _by_group, along each group's tokens)
    tap_ct = observed_gradient(
        static,
        Operand(x=g, fmt=r.grad, axis=1),
        Operand(x=g_by_group, fmt=r.grad, axis=0),
    )
    dlhs = vma_like(dlhs.astype(static.lhs_dtype), saved[0])
    drhs = vma_like(drhs.astype(static.rhs_dtype), saved[1])
    if static.quantized_lhs is not None:  # the codes get none, the carrier the gradient
        dlhs = _Quantized(jax.tree.map(_zero_cotangent, static.quantized_lhs), dlhs)
    return dlhs, drhs, None, None, tap_ct


def _shape_of(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _zero_cotangent(x: jax.ShapeDtypeStruct):
    """The cotangent of an integer array: float0 zeros."""
    return np.zeros(x.shape, jax.dtypes.float0)


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


_WHERE = "jaxmx.ragged_dot"
_RHT_ROWS = 16  # the Hadamard block of Recipe.rht (jaxmx.rht's default size)
