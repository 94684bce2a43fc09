"""The operands of the native GEMMs on MXArrays: one check for every family, the TN form.

Every family takes ``a`` [..., M, K] and ``b`` [..., N, K] quantized along K (the TN form); the
MX and per-tensor / per-row FP8 GEMMs also take K-first operands ([..., K, rows] quantized along
axis -2). :func:`checked_pair` checks a pair for one family and names what it refuses.

Example:
    >>> import jax.numpy as jnp, jaxmx
    >>> q = jaxmx.quantize(jnp.ones((2, 32, 3)), axis=1)  # [..., K, rows]
    >>> is_k_first(q), tn_form(q).shape, tn_form(q).axis
    (True, (2, 3, 32), 2)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core import wire
from jaxmx._src.core.block_sharding import ReducedAxis, check_block_alignment
from jaxmx._src.core.dtypes import check_float_dtype
from jaxmx._src.core.mxarray import MXArray, check_gemm_pair, checked
from jaxmx._src.core.mxarray_layouts import swap_last_axes
from jaxmx._src.gemm import extension
from jaxmx._src.gemm.capabilities import native_pair


def checked_pair(a, b, out_dtype, fn: str, formats: tuple[str, ...], *, k_first_ok: bool):
    """``(a, b, out_dtype)`` of the native GEMM ``fn`` after its checks: each operand
    (:func:`checked_operand`), the pair (one scale kind, cuBLASLt's FP8 type table), equal K and
    batch dims, the output dtype; the custom-call targets registered.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> a = jaxmx.quantize(jnp.ones((4, 64)), "mxfp8_e5m2")
        >>> checked_pair(a, a, jnp.float32, "mx_matmul", ("mxfp8_e5m2",), k_first_ok=True)
        Traceback (most recent call last):
        NotImplementedError: mx_matmul: mxfp8_e5m2 x mxfp8_e5m2 is not supported by the native ...
    """
    a = checked_operand(a, "a", fn, formats, k_first_ok=k_first_ok)
    b = checked_operand(b, "b", fn, formats, k_first_ok=k_first_ok)
    if not native_pair((a.fmt, b.fmt)):
        raise NotImplementedError(f"{fn}: {_pair_problem(a, b)}")
    check_gemm_pair(a, b, fn)
    out_dtype = check_float_dtype(out_dtype, f"{fn}: out_dtype")
    extension.register_targets()
    return a, b, out_dtype


def checked_operand(q, name: str, fn: str, formats: tuple[str, ...], *, k_first_ok: bool):
    """``q`` checked as operand ``name`` of the native GEMM ``fn``: an MXArray of one of
    ``formats``, quantized along its last axis (TN form: [..., rows, K]) or, where
    ``k_first_ok``, along axis -2 ([..., K, rows]); for block-scaled formats, each shard of K
    (under an Explicit sharding) whole blocks.

    Example:
        >>> import jax.numpy as jnp, jaxmx
        >>> q = jaxmx.quantize(jnp.ones((32, 4)), "fp8_e4m3_row", axis=0)
        >>> checked_operand(q, "a", "fp4_matmul", ("fp8_e4m3_row",), k_first_ok=False)
        Traceback (most recent call last):
        ValueError: fp4_matmul: a must be [..., rows, K] quantized along its last axis (TN ...)
    """
    q = checked(q, f"{fn}: {name}")
    if q.fmt not in formats:
        raise NotImplementedError(
            f"{fn}: {name} is {q.fmt}, which this native GEMM does not support "
            f"(supported: {', '.join(formats)}); use the emulation backend"
        )
    if q.ndim < 2 or q.axis < q.ndim - (2 if k_first_ok else 1):
        k_first_form = " or [..., K, rows] quantized along axis -2 (K-first)" if k_first_ok else ""
        transposed = (
            ""
            if k_first_ok
            else "; quantize the transposed tensor (jaxmx.quantize_rowwise_colwise gives both "
            "copies)"
        )
        raise ValueError(
            f"{fn}: {name} must be [..., rows, K] quantized along its last axis (TN form)"
            f"{k_first_form}, got axis {q.axis} of logical shape {q.shape}{transposed}"
        )
    if q.format.span == "block":
        k = ReducedAxis(q.data_axis, "K", "the contracting dimension")
        check_block_alignment(q.data, f"jaxmx.ffi.{fn}", name, (k,), q.format.block)
    return q


def _pair_problem(a: MXArray, b: MXArray) -> str:
    """Why no native GEMM takes the pair of a family's formats ``a`` x ``b``."""
    if a.format.scale_kind != b.format.scale_kind:
        return (
            f"a is {a.fmt} and b is {b.fmt}; the native GEMM takes operands of one scale kind "
            "(two MXFP4 or two NVFP4 for FP4: cuBLASLt scales both with one mode); quantize "
            "both in one format, or use the emulation backend"
        )
    return (
        f"{a.fmt} x {b.fmt} is not supported by the native GEMM (cuBLASLt has E4M3 x E4M3, "
        "E4M3 x E5M2 and E5M2 x E4M3); use the emulation backend, or E4M3 for one operand"
    )


def is_k_first(q: MXArray) -> bool:
    """Whether ``q`` is [..., K, rows], quantized along its axis -2."""
    return q.axis == q.ndim - 2


def tn_form(q: MXArray) -> MXArray:
    """``q`` in TN form ([..., rows, K] quantized along its last axis): a K-first operand has
    its 1-byte codes and scales transposed."""
    return swap_last_axes(q) if is_k_first(q) else q


def zero_padding(q: MXArray) -> jax.Array:
    """The codes of ``q`` with any padding along K set to zero (whatever a hand-built one holds)."""
    k = q.shape[q.axis]
    if k == q.data.shape[q.data_axis]:
        return q.data
    codes = wire.as_bytes(q.data)
    index = lax.broadcasted_iota(jnp.int32, codes.shape, q.data_axis)
    return wire.from_bytes(jnp.where(index < k, codes, 0).astype(jnp.uint8), q.data.dtype)
