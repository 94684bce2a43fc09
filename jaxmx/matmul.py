"""The MX GEMM on TN operands: ``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]``.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> a = jaxmx.quantize(jnp.ones((2, 64)), "mxfp8_e4m3")
    >>> b = jaxmx.quantize(jnp.full((3, 64), 0.5), "mxfp8_e4m3")
    >>> jaxmx.matmul(a, b, jnp.float32).tolist()
    [[32.0, 32.0, 32.0], [32.0, 32.0, 32.0]]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx.mxarray import MXArray
from jaxmx.quantize import dequantize

_ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


def matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16, backend: str = "emulate") -> jax.Array:
    """Multiplies two MX operands in TN form with float32 accumulation.

    Args:
        a: [..., M, K] quantized along K (its last axis).
        b: [..., N, K] quantized along K, same leading (batch) shape as ``a``.
        out_dtype: dtype of the result [..., M, N].
        backend: ``"emulate"`` (exact, any device), ``"ffi"`` (the native custom call) or
            ``"auto"`` (cuBLASLt where this machine supports it, else emulate).

    Emulation dequantizes exactly and runs ``lax.dot_general`` with float32 accumulation. On GPUs
    and TPUs the dequantized operands are fed as bfloat16: an E4M3/E5M2 code times a power of two
    is exact in bfloat16 unless it falls below 2^-126 (scale bytes under about 10, i.e. blocks
    whose maximum is below ~2^-109), and bf16 x bf16 products are exact in float32. On the CPU,
    where bfloat16 brings no speed, operands are float32 and exact over the whole E8M0 range.
    """
    _check_operands(a, b)
    backend = resolve_backend(backend)
    if backend == "ffi":
        from jaxmx import ffi

        return ffi.mx_matmul(a, b, out_dtype)
    return _emulate(a, b, out_dtype)


def resolve_backend(backend: str) -> str:
    """Maps ``"auto"`` to ``"ffi"`` where cuBLASLt MX GEMMs run here, else to ``"emulate"``."""
    if backend == "emulate" or backend == "ffi":
        return backend
    if backend == "auto":
        from jaxmx import ffi

        return "ffi" if ffi.cublaslt_supported() else "emulate"
    raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'emulate' or 'ffi'")


@functools.partial(jax.jit, static_argnums=2)
def _emulate(a: MXArray, b: MXArray, out_dtype) -> jax.Array:
    operand_dtype = jnp.bfloat16 if jax.default_backend() in _ACCELERATORS else jnp.float32
    batch = tuple(range(a.data.ndim - 2))
    k = a.data.ndim - 1
    out = lax.dot_general(
        dequantize(_padded(a), operand_dtype),
        dequantize(_padded(b), operand_dtype),
        (((k,), (k,)), (batch, batch)),
        preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype)


def _padded(q: MXArray) -> MXArray:
    """The same operand with its logical K set to the padded K (padding codes are zero)."""
    return MXArray(q.data, q.scale, q.fmt, q.axis, tuple(q.data.shape))


def _check_operands(a: MXArray, b: MXArray) -> None:
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, MXArray):
            raise TypeError(f"matmul operand {name} must be an MXArray, got {type(q).__name__}")
        if q.ndim < 2 or q.axis != q.ndim - 1:
            raise ValueError(
                f"matmul operand {name} must be [..., rows, K] quantized along its last axis "
                f"(TN form), got shape {q.shape} quantized along axis {q.axis}"
            )
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"matmul: contracting sizes differ, a has K={a.shape[-1]}, b has K={b.shape[-1]}"
        )
    if a.data.shape[:-2] != b.data.shape[:-2]:
        raise ValueError(
            f"matmul: batch shapes differ, a {a.data.shape[:-2]} vs b {b.data.shape[:-2]}"
        )
