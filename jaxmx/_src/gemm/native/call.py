"""The custom call of every native GEMM, lowered per platform.

:func:`custom_call` runs one target of the ``jaxmx._ffi`` extension on ``(a, b, a_scale, b_scale,
...)``: a CPU branch (the C++ handler, always built), a CUDA branch (the cuBLASLt handler, built
with ``JAXMX_CUDA=ON``, with its workspace as a second output) and, for platforms without a
handler, a branch that fails at lowering with the reason.

Example:
    >>> import jax.numpy as jnp
    >>> codes = jnp.ones((3, 64), jnp.float8_e4m3fn)
    >>> data, scale, n = pad_rows(codes, jnp.ones((3, 2), jnp.float8_e8m0fnu), 16)
    >>> data.shape, scale.shape, scale.dtype, n
    ((16, 64), (16, 2), dtype('uint8'), 3)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxmx._src.core import bits
from jaxmx._src.core.vma import vary_like
from jaxmx._src.gemm import capabilities

WORKSPACE_BYTES = 32 * 1024 * 1024
"""cuBLASLt workspace, allocated by XLA as a second output of the custom call (GPU only), plus
256 bytes so that the handler can hand cuBLASLt a 256-byte aligned part of this size."""

N_MULTIPLE = 16
"""cuBLASLt: rows of out^T (the rhs rows) padded so every row of out starts 16-byte aligned."""

# (platform, workspace bytes, rows of the rhs padded to a multiple of)
_PLATFORMS = (("cpu", 0, 1), ("cuda", WORKSPACE_BYTES + 256, N_MULTIPLE))


def custom_call(
    target: str, fn: str, out_dtype, prepare, *args, attributes=None, k_first=(False, False)
) -> jax.Array:
    """``target`` on ``(a, b, a_scale, b_scale)`` with the custom call's ``attributes``, lowered
    per platform.

    ``prepare(n_multiple, *args)`` gives the custom call's operands, the rhs rows padded to
    ``n_multiple``, and the number of output columns to keep. ``k_first``: whether ``a`` and
    ``b`` are [..., K, rows] instead of [..., rows, K] (the MX GEMM). Platforms without a
    handler (:meth:`~jaxmx._src.gemm.capabilities.Capabilities.handler`) get a branch that
    fails at lowering with the reason.
    """

    def rows(x, k_first_operand: bool) -> int:
        return x.shape[-1] if k_first_operand else x.shape[-2]

    def branch(workspace: int, n_multiple: int):
        def run(*args):
            operands, n = prepare(n_multiple, *args)
            out_shape = (*operands[0].shape[:-2], rows(operands[0], k_first[0]))
            out_shape += (rows(operands[1], k_first[1]),)
            out, _ = jax.ffi.ffi_call(
                target,
                (
                    jax.ShapeDtypeStruct(out_shape, out_dtype),
                    jax.ShapeDtypeStruct((workspace,), jnp.uint8),
                ),
            )(*operands, **(attributes or {}))
            # the operands' rows, padded for cuBLASLt, sliced back; inside shard_map: varying
            # like the operands (ffi_call results are not)
            return vary_like(out[..., : rows(args[0], k_first[0]), :n], *args)

        return run

    branches = {
        platform: branch(workspace, n_multiple)
        for platform, workspace, n_multiple in _PLATFORMS
        if capabilities.current().handler(platform) == "available"
    }

    def unsupported(*args):
        a, b = args[0], args[1]
        out = _unsupported_p.bind(
            *args,
            shape=(*a.shape[:-2], rows(a, k_first[0]), rows(b, k_first[1])),
            dtype=out_dtype,
            fn=fn,
            handled=tuple(branches),
        )
        return vary_like(out, *args)

    return lax.platform_dependent(*args, **branches, default=unsupported)


def pad_rows(data, scale, multiple: int):
    """Zero rows appended to a [..., N, K] operand (and its [..., N, *] scales) up to a multiple.

    Zero codes contribute nothing whatever their scale, and the extra output columns are dropped.
    """
    n = data.shape[-2]
    pad = -n % multiple
    if pad:
        widths = [(0, 0)] * (data.ndim - 2) + [(0, pad), (0, 0)]
        data = jnp.pad(data, widths)
        if scale.ndim == data.ndim:
            scale = jnp.pad(bits.as_bytes(scale), widths)
    return data, scale, n


# The default branch of the custom calls: lowering it (for a platform without a handler) raises.
_unsupported_p = Primitive("jaxmx_ffi_unsupported_platform")
_unsupported_p.def_abstract_eval(
    lambda *args, shape, dtype, fn, handled: jax.core.ShapedArray(shape, dtype)
)
_unsupported_p.def_impl(
    lambda *args, **params: jax.jit(functools.partial(_unsupported_p.bind, **params))(*args)
)


def _unsupported_lowering(ctx, *args, shape, dtype, fn, handled):
    platforms = [p for p in ctx.module_context.platforms if p not in handled]
    here = capabilities.current()
    reasons = "; ".join(f"{p}: {here.handler(p)}" for p in platforms)
    raise RuntimeError(
        f"jaxmx.ffi.{fn}: the native GEMM (backend='ffi') has no handler for platform "
        f"{', '.join(repr(p) for p in platforms) or 'this platform'} ({reasons or 'unknown'}); "
        "use backend='emulate' there"
    )


mlir.register_lowering(_unsupported_p, _unsupported_lowering)
