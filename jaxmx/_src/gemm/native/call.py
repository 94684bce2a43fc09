"""The custom call of every native GEMM, lowered per platform.

:func:`custom_call` runs one target of the ``jaxmx._ffi`` extension on ``(a, b, a_scale, b_scale,
...)`` as one primitive with a lowering per platform (no ``lax.platform_dependent``: the GEMM
executor's is the only one on a GEMM's path): on the CPU the C++ handler (always built), on CUDA
the cuBLASLt handler (built with ``JAXMX_CUDA=ON``) with its workspace as a second result of
the custom call; lowering for any other platform, or for one whose handler this machine lacks
(:meth:`~jaxmx._src.gemm.capabilities.Capabilities.handler`), raises with the reason. A
lowering for several platforms at once (``jax.export``) gets JAX's switch over them.

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
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxmx._src.core import wire
from jaxmx._src.core.vma import vary_like
from jaxmx._src.gemm import capabilities

WORKSPACE_BYTES = 32 * 1024 * 1024
"""cuBLASLt workspace, allocated by XLA as a second output of the custom call (GPU only), plus
256 bytes so that the handler can hand cuBLASLt a 256-byte aligned part of this size."""

N_MULTIPLE = 16
"""cuBLASLt: rows of out^T (the rhs rows) padded so every row of out starts 16-byte aligned
(on every platform: the operands of one custom call are the same whatever it lowers for)."""

_WORKSPACES = {"cpu": 0, "cuda": WORKSPACE_BYTES + 256}  # the platforms with a handler


def custom_call(
    target: str, fn: str, out_dtype, prepare, *args, attributes=None, k_first=(False, False)
) -> jax.Array:
    """``target`` on ``(a, b, a_scale, b_scale)`` with the custom call's ``attributes``, lowered
    per platform (see the module docstring).

    ``prepare(*args)`` gives the custom call's operands, the rhs rows padded to a multiple of
    :data:`N_MULTIPLE`, and the number of output columns to keep. ``k_first``: whether ``a`` and
    ``b`` are [..., K, rows] instead of [..., rows, K] (the MX GEMM).
    """

    def rows(x, k_first_operand: bool) -> int:
        return x.shape[-1] if k_first_operand else x.shape[-2]

    operands, n = prepare(*args)
    out_shape = (*operands[0].shape[:-2], rows(operands[0], k_first[0]))
    out_shape += (rows(operands[1], k_first[1]),)
    out = _native_gemm_p.bind(
        *operands,
        target=target,
        fn=fn,
        shape=out_shape,
        dtype=jnp.dtype(out_dtype),
        attributes=tuple(sorted((attributes or {}).items())),
    )
    # the operands' rows, padded for cuBLASLt, sliced back; inside shard_map: varying like the
    # operands (the custom call's results are not)
    return vary_like(out[..., : rows(args[0], k_first[0]), :n], *args)


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
            scale = jnp.pad(wire.as_bytes(scale), widths)
    return data, scale, n


# One native GEMM's custom call: ``shape`` / ``dtype`` its result, ``fn`` the public function
# for messages, ``attributes`` the custom call's (name, value) pairs.
_native_gemm_p = Primitive("jaxmx_native_gemm")
_native_gemm_p.def_abstract_eval(
    lambda *args, target, fn, shape, dtype, attributes: jax.core.ShapedArray(shape, dtype)
)
_native_gemm_p.def_impl(
    lambda *args, **params: jax.jit(functools.partial(_native_gemm_p.bind, **params))(*args)
)


def _lowering(platform: str | None):
    """The lowering of :data:`_native_gemm_p` for ``platform`` (None: every other platform):
    the handler's custom call with its workspace result, or a RuntimeError saying why there
    is none."""

    def lower(ctx, *args, target, fn, shape, dtype, attributes):
        status = capabilities.current().handler(platform) if platform else None
        if status != "available":
            platforms = [platform] if platform else ctx.module_context.platforms
            here = capabilities.current()
            reasons = "; ".join(f"{p}: {here.handler(p)}" for p in platforms)
            raise RuntimeError(
                f"jaxmx.ffi.{fn}: the native GEMM (backend='ffi') has no handler for platform "
                f"{', '.join(repr(p) for p in platforms)} ({reasons}); use backend='emulate' there"
            )
        workspace = jax.core.ShapedArray((_WORKSPACES[platform],), jnp.uint8)
        with_workspace = ctx.replace(avals_out=[*ctx.avals_out, workspace])
        out, _ = jax.ffi.ffi_lowering(target)(with_workspace, *args, **dict(attributes))
        return [out]

    return lower


mlir.register_lowering(_native_gemm_p, _lowering(None))
for _platform in _WORKSPACES:
    mlir.register_lowering(_native_gemm_p, _lowering(_platform), platform=_platform)
