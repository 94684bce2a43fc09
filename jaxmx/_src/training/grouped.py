"""The grouped GEMM's pieces around its VJP (:mod:`~jaxmx._src.training.ragged`): the recipe it
runs (:func:`grouped_recipe`), the check of concrete group sizes, the token layout of its
weight gradient (:func:`group_padded`: each group from a multiple of the block), and the
``lax.ragged_dot`` calls that ``jax.vmap`` batches whichever operands are mapped
(:data:`BY_ROWS`, :data:`BY_TOKENS`).

Example:
    >>> import jax.numpy as jnp
    >>> x, sizes = group_padded(jnp.arange(1.0, 4.0)[:, None], jnp.array([1, 2]), 4)
    >>> x[:, 0].tolist(), sizes.tolist()
    ([1.0, 0.0, 0.0, 0.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [4, 4])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmx._src.core.formats import get_format
from jaxmx._src.core.recipes import Recipe, check_recipe
from jaxmx._src.core.sizes import round_up
from jaxmx._src.core.support import lacks
from jaxmx._src.gemm.dispatch import GROUPED_BACKEND, Gemm, kernels


def grouped_recipe(recipe: Recipe) -> Recipe:
    """The recipe :func:`jaxmx.ragged_dot` runs for ``recipe``: the same fields but the
    dispatcher's backend for grouped GEMMs, the emulation (there is no native grouped GEMM yet).

    Weight tiles and the Hadamard transform need no change: a tile covers part of one expert's
    ``[k, n]`` matrix, never two experts, and the transform of the weight-gradient operands runs
    within each group's zero-padded whole blocks of tokens, which is exact per group. So every
    preset of :mod:`jaxmx.recipes` runs as it is. What has no grouped form raises a
    NotImplementedError: the native backend, the ``lax.scaled_dot`` one (it has no grouped
    form), ``accum_bits`` (the modelled accumulator needs the blocked emulation of
    :func:`jaxmx.matmul`), ``exact_emulation`` (its operands are decoded to float32), the
    per-tensor and per-row formats and ``wgrad="high_precision"``.

    Example:
        >>> import jaxmx
        >>> r = jaxmx.grouped_recipe(jaxmx.recipes.NVFP4)
        >>> r.weight_tile, r.rht, r == jaxmx.recipes.NVFP4.replace(backend=r.backend)
        ((16, 16), True, True)
        >>> r.backend                                   # the emulation: no native grouped GEMM
        'emulate'
    """
    check_recipe(recipe, "jaxmx.grouped_recipe")
    # the dispatcher's answer for a grouped GEMM: decoded operands on every platform (or its
    # refusal of the backends without a grouped form), which _ragged's decode then
    # lax.ragged_dot implement
    kernels(Gemm(formats=(recipe.fwd, recipe.grad), backend=recipe.backend, grouped=True))
    if recipe.accum_bits is not None:
        raise NotImplementedError(
            "jaxmx.ragged_dot: Recipe.accum_bits (a modelled limited accumulator) is not "
            "available for grouped GEMMs; use a recipe without it"
        )
    for f in (get_format(recipe.fwd), get_format(recipe.grad)):
        if missing := lacks(f, "grouped"):  # its wgrad scale would span every group's tokens
            raise NotImplementedError(
                f"jaxmx.ragged_dot: {f.name} ({missing}) has no grouped form yet "
                "(the weight-gradient scales would need one per group); use a block format"
            )
    if recipe.exact_emulation:
        raise NotImplementedError(
            "jaxmx.ragged_dot: Recipe.exact_emulation is not available for grouped GEMMs, "
            "which multiply float32 decoded operands (no row-relative frame to leave); use a "
            "recipe without it"
        )
    if recipe.wgrad != "quantized":
        raise NotImplementedError(
            f"jaxmx.ragged_dot: Recipe.wgrad={recipe.wgrad!r} is not available for grouped "
            "GEMMs; use wgrad='quantized'"
        )
    return recipe.replace(backend=GROUPED_BACKEND)


def check_group_sizes(group_sizes: jax.Array) -> None:
    """A ValueError for concrete ``group_sizes`` with a negative entry; traced ones (under
    ``jit``) cannot be checked and are taken as they are."""
    if isinstance(group_sizes, jax.core.Tracer):
        return
    sizes = np.asarray(group_sizes)  # numpy: a jnp comparison would trace under remat
    if (sizes < 0).any():
        raise ValueError(
            f"jaxmx.ragged_dot: group_sizes must be non-negative, got {sizes.tolist()}"
        )


def group_padded(x: jax.Array, group_sizes: jax.Array, block: int):
    """(rows of ``x`` laid out so that each group starts at a multiple of ``block``, zeros in
    between and after, and the padded group sizes). ``x`` is ``[m, ...]``; the result has a static
    ``roundup(m + (block - 1) g, block)`` rows."""
    m, g = x.shape[0], group_sizes.shape[0]
    rows = round_up(m + (block - 1) * g, block)
    padded_sizes = round_up(group_sizes, block)
    ends = jnp.cumsum(group_sizes)
    starts, padded_starts = ends - group_sizes, jnp.cumsum(padded_sizes) - padded_sizes
    i = jnp.arange(m)
    group = jnp.searchsorted(ends, i, side="right")  # g for rows past the last group
    inside = group < g
    group = jnp.minimum(group, g - 1)
    target = jnp.where(inside, padded_starts[group] + i - starts[group], rows)
    out = jnp.zeros((rows, *x.shape[1:]), x.dtype).at[target].set(x, mode="drop")
    return out, padded_sizes


def batchable(dims: lax.RaggedDotDimensionNumbers):
    """``(lhs, rhs, group_sizes) -> lax.ragged_dot_general(...)`` with ``dims`` and a float32
    result, which ``jax.vmap`` batches whichever operands are mapped: ``lax.ragged_dot``'s own
    batching rule takes only all three mapped along axis 0, so the others are broadcast to it.
    (``jax.jacfwd`` vmaps the forward GEMM over unmapped operands.)"""

    def dot(lhs, rhs, group_sizes):
        return lax.ragged_dot_general(
            lhs, rhs, group_sizes, dims, preferred_element_type=jnp.float32
        )

    batched = jax.custom_batching.custom_vmap(dot)

    @batched.def_vmap
    def _all_mapped(axis_size, in_batched, *operands):
        operands = [
            x if mapped else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, mapped in zip(operands, in_batched, strict=True)
        ]
        return jax.vmap(dot)(*operands), True

    return batched


# lhs [m, k] by rows, each group's rows times its rhs [k, n]: out [m, n] (lax.ragged_dot)
BY_ROWS = batchable(
    lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (1,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
)
# lhs [k, t] and rhs [t, n] over each group's tokens t: out [g, k, n]
BY_TOKENS = batchable(
    lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (0,)), ((), ())),
        lhs_ragged_dimensions=[1],
        rhs_group_dimensions=[],
    )
)
