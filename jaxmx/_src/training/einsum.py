"""``jaxmx.einsum``: two-operand einsum through :func:`jaxmx.dot_general`.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> x = jnp.ones((2, 3, 64)); w = jnp.ones((5, 64))
    >>> jaxmx.einsum("btd,hd->bth", x, w).shape
    (2, 3, 5)
"""

from __future__ import annotations

import string

import jax

from jaxmx._src.core.dtypes import as_float_array
from jaxmx._src.core.recipes import MXFP8, Recipe, check_recipe
from jaxmx._src.training.dot_general import dot_general


def einsum(
    subscripts: str,
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    preferred_element_type=None,
    recipe: Recipe | None = MXFP8,
    key: jax.Array | None = None,
) -> jax.Array:
    """Evaluates a two-operand einsum with MX-quantized GEMMs (see :func:`jaxmx.dot_general`).

    Indices shared by both operands and kept in the output are batch dimensions, shared indices
    dropped from the output are contracted, and an index that only one operand has and the
    output drops is summed out before the GEMM. ``...`` stands for the same dimensions, aligned
    from the right, in every operand that has it (sizes must match: no size-1 broadcasting). An
    index repeated within one operand (a diagonal) is not supported.
    """
    check_recipe(recipe, "jaxmx.einsum", optional=True)  # None: plain high precision
    if not isinstance(subscripts, str):
        raise TypeError(
            f"jaxmx.einsum: subscripts must be a string such as 'mk,nk->mn', got "
            f"{type(subscripts).__name__}"
        )
    lhs, rhs = as_float_array(lhs, "jaxmx.einsum: lhs"), as_float_array(rhs, "jaxmx.einsum: rhs")
    lhs_idx, rhs_idx, out_idx = _parse(subscripts, lhs.ndim, rhs.ndim)
    lhs, lhs_idx = _sum_unshared(lhs, lhs_idx, rhs_idx + out_idx)
    rhs, rhs_idx = _sum_unshared(rhs, rhs_idx, lhs_idx + out_idx)
    shared = [c for c in lhs_idx if c in rhs_idx]
    batch = [c for c in shared if c in out_idx]
    contract = [c for c in shared if c not in out_idx]
    dims = (
        (tuple(lhs_idx.index(c) for c in contract), tuple(rhs_idx.index(c) for c in contract)),
        (tuple(lhs_idx.index(c) for c in batch), tuple(rhs_idx.index(c) for c in batch)),
    )
    y = dot_general(
        lhs, rhs, dims, preferred_element_type=preferred_element_type, recipe=recipe, key=key
    )
    y_idx = (
        batch + [c for c in lhs_idx if c not in shared] + [c for c in rhs_idx if c not in shared]
    )
    if sorted(y_idx) != sorted(out_idx):
        raise ValueError(f"einsum {subscripts!r}: output indices {out_idx} cannot be produced")
    return y.transpose([y_idx.index(c) for c in out_idx])


def _parse(subscripts: str, lhs_ndim: int, rhs_ndim: int):
    spec = subscripts.replace(" ", "")
    inputs, arrow, output = spec.partition("->")
    operands = inputs.split(",")
    if len(operands) != 2:
        raise ValueError(f"jaxmx.einsum takes exactly two operands, got {subscripts!r}")
    spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in spec]
    ellipsis_ndims = [
        ndim - len(op.replace("...", "")) if "..." in op else 0
        for op, ndim in ((operands[0], lhs_ndim), (operands[1], rhs_ndim))
    ]
    fill = "".join(spare[: max(*ellipsis_ndims, 0)])  # ellipsis dims, aligned from the right
    lhs, rhs = (
        op.replace("...", fill[len(fill) - n :] if n > 0 else "")
        for op, n in zip(operands, ellipsis_ndims, strict=True)
    )
    if not arrow:  # implicit output: broadcast dims, then indices seen once, alphabetically
        singles = sorted(c for c in set(lhs + rhs) if (lhs + rhs).count(c) == 1 and c not in fill)
        output = fill + "".join(singles)
    output = output.replace("...", fill)
    for name, op, ndim in (("lhs", lhs, lhs_ndim), ("rhs", rhs, rhs_ndim)):
        if len(op) != ndim or not op.isalpha():
            raise ValueError(
                f"einsum {subscripts!r}: {name} subscripts {op!r} do not match rank {ndim}"
            )
        if len(set(op)) != len(op):
            raise ValueError(f"einsum {subscripts!r}: repeated index in {op!r} is not supported")
    if len(set(output)) != len(output) or any(c not in lhs + rhs for c in output):
        raise ValueError(f"einsum {subscripts!r}: invalid output subscripts {output!r}")
    return list(lhs), list(rhs), list(output)


def _sum_unshared(x: jax.Array, idx: list[str], elsewhere: list[str]):
    summed = tuple(i for i, c in enumerate(idx) if c not in elsewhere)
    if not summed:
        return x, idx
    return x.sum(axis=summed), [c for c in idx if c in elsewhere]
