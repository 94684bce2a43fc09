"""vmap for the native GEMMs: a leading batch, or rows folded into M, instead of a loop.

``custom_partitioning`` and the FFI custom call have no batching rule of their own; the native
GEMMs are wrapped in :func:`vmappable`.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmx._src.gemm.batching import vmappable
    >>> mm = vmappable(lambda a, b, sa, sb: a @ b.swapaxes(-1, -2), fold=(True, False, True, False))
    >>> ones = jnp.ones((3, 2, 4))
    >>> jax.vmap(mm, in_axes=(0, None, 0, None))(ones, jnp.ones((5, 4)), ones, ones[0]).shape
    (3, 2, 5)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def vmappable(impl: Callable, fold: tuple[bool, ...] | None) -> Callable:
    """``impl(lhs, rhs, lhs_scale, rhs_scale, *rest)`` (equal leading batch dims) made vmappable.

    Under ``vmap`` the batch becomes a leading dim of one call (one custom call and workspace for
    the native GEMM), not a loop: when exactly the arguments ``fold`` marks (one flag per
    argument, e.g. the lhs and its scales) are batched and the rhs has no batch dims, the batch
    is folded into M (one bigger GEMM); otherwise (and always with ``fold=None``, e.g. for an lhs
    stored K-first, whose rows are its last axis) unbatched operands are broadcast.
    (``custom_partitioning`` has no batching rule of its own, so the partitioned GEMM is wrapped
    in this.)
    """
    f = jax.custom_batching.custom_vmap(impl)

    @f.def_vmap
    def rule(axis_size, in_batched, *args):
        if fold is not None and tuple(in_batched) == fold and args[1].ndim == 2:
            m = args[0].shape[1]
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
