"""The MX GEMM: ``out[..., m, n] = sum_k a[..., m, k] * b[..., n, k]`` on MX operands.

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

from jaxmx import partitioning
from jaxmx.mxarray import MXArray
from jaxmx.quantize import dequantize_for_dot
from jaxmx.recipes import BACKENDS

_ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


def matmul(a: MXArray, b: MXArray, out_dtype=jnp.bfloat16, backend: str = "auto") -> jax.Array:
    """Multiplies two MX operands, each quantized along the contracting axis K.

    Args:
        a: [..., M, K] quantized along K (its last axis: the TN form), or [..., K, M] quantized
            along K (its axis -2: a columnwise copy kept untransposed).
        b: [..., N, K] or [..., K, N] likewise, with the same leading (batch) shape as ``a``.
        out_dtype: dtype of the result [..., M, N].
        backend: ``"auto"`` (default: cuBLASLt where this machine supports it and the formats
            are native, else emulate), ``"emulate"`` (any device) or ``"ffi"`` (the native
            custom call, which takes TN operands: others are transposed first).

    Emulation decodes the operands (:func:`jaxmx.quantize.dequantize_for_dot`) and runs
    ``lax.dot_general`` with float32 accumulation, contracting each operand in its own layout.
    On GPUs and TPUs the operands are fed as bfloat16: an E4M3/E5M2 code times a power of two is
    exact in bfloat16 unless it falls below 2^-126 (blocks whose maximum is below ~2^-109), and
    bf16 x bf16 products are exact in float32. On the CPU, where bfloat16 brings no speed, they
    are float32; XLA:CPU's float32 arithmetic flushes subnormals, so operands, products and
    partial sums below 2^-126 become zero (the native GEMM keeps them). That only touches blocks
    whose two scales multiply to less than about 2^-110.
    """
    _check_operands(a, b)
    backend = resolve_backend(backend, (a.fmt, b.fmt))
    if backend == "ffi":
        from jaxmx import ffi

        return ffi.mx_matmul(_tn(a), _tn(b), out_dtype)
    return _emulate(a, b, out_dtype)


def resolve_backend(backend: str, formats: tuple[str, ...] = ()) -> str:
    """The backend that runs: ``"auto"`` becomes ``"ffi"`` where cuBLASLt MX GEMMs run on this
    machine and every one of ``formats`` is native there (MXFP8), else ``"emulate"``."""
    if backend in ("emulate", "ffi"):
        return backend
    if backend == "auto":
        from jaxmx import ffi

        native = all(f in ffi.NATIVE_FORMATS for f in formats)
        return "ffi" if native and ffi.cublaslt_supported() else "emulate"
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


@functools.partial(jax.jit, static_argnums=2)
def _emulate(a: MXArray, b: MXArray, out_dtype) -> jax.Array:
    layout = (_side(a, "mk"), _side(b, "nk"))
    call = _emulate_call(jnp.dtype(out_dtype), a.fmt, b.fmt, layout)
    return call(a.data, b.data, a.scale, b.scale)


@functools.cache
def _emulate_call(out_dtype, a_fmt: str, b_fmt: str, layout: tuple[str, str]):
    # The native GEMM's SPMD partitioning rule (jaxmx.partitioning), so a sharded emulated GEMM
    # communicates what the native one does: 1-byte codes and scales, float32 partial sums.
    per_shard = _emulate_per_shard(a_fmt, b_fmt, layout)
    gemm = partitioning.partitioned_gemm(per_shard, out_dtype, "jaxmx.matmul", layout)
    fold = (True, False, True, False) if layout == partitioning.TN else None
    return partitioning.vmappable(gemm, fold=fold)


@functools.cache
def _emulate_per_shard(a_fmt: str, b_fmt: str, layout: tuple[str, str]):
    @functools.cache
    def per_shard(out_dtype):
        def gemm(a_data, b_data, a_scale, b_scale):
            nd = a_data.ndim
            ka, kb = (nd - 1 if side[-1] == "k" else nd - 2 for side in layout)
            a = MXArray(a_data, a_scale, a_fmt, ka, tuple(a_data.shape))
            b = MXArray(b_data, b_scale, b_fmt, kb, tuple(b_data.shape))
            operand_dtype = jnp.bfloat16 if jax.default_backend() in _ACCELERATORS else jnp.float32
            batch = tuple(range(nd - 2))
            out = lax.dot_general(
                dequantize_for_dot(a, operand_dtype),
                dequantize_for_dot(b, operand_dtype),
                (((ka,), (kb,)), (batch, batch)),
                preferred_element_type=jnp.float32,
            )
            return out.astype(out_dtype)

        return gemm

    return per_shard


def _side(q: MXArray, tn: str) -> str:
    """``tn`` ("mk" / "nk") when ``q`` is blocked along its last axis, else its K-first form."""
    return tn if q.axis == q.ndim - 1 else tn[::-1]


def _tn(q: MXArray) -> MXArray:
    """``q`` in TN form: a K-first operand is transposed (its 1-byte codes and scales)."""
    if q.axis == q.ndim - 1:
        return q

    def swap(x):
        return x.swapaxes(-1, -2)

    shape = (*q.shape[:-2], q.shape[-1], q.shape[-2])
    return MXArray(swap(q.data), swap(q.scale), q.fmt, q.ndim - 1, shape)


def _check_operands(a: MXArray, b: MXArray) -> None:
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, MXArray):
            raise TypeError(f"matmul operand {name} must be an MXArray, got {type(q).__name__}")
        if q.ndim < 2 or q.axis < q.ndim - 2:
            raise ValueError(
                f"matmul operand {name} must be quantized along K, one of its last two axes "
                f"([..., rows, K] or [..., K, rows]), got shape {q.shape} quantized along axis "
                f"{q.axis}"
            )
    if a.shape[a.axis] != b.shape[b.axis]:
        raise ValueError(
            f"matmul: contracting sizes differ, a has K={a.shape[a.axis]}, b has "
            f"K={b.shape[b.axis]}"
        )
    if a.data.shape[:-2] != b.data.shape[:-2]:
        raise ValueError(
            f"matmul: batch shapes differ, a {a.data.shape[:-2]} vs b {b.data.shape[:-2]}"
        )
