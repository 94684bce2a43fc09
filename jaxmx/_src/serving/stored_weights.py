"""Weights at rest: a trained kernel stored as an :class:`~jaxmx.MXArray` and the forward-only
GEMM that consumes it (:func:`store_weight`, :func:`weight_matmul`).

A kernel ``[*in, *out]`` whose first ``contracting`` dims are contracted (K, their product; N,
the product of the rest) is stored as the 2-D ``[N, K]`` MXArray ``quantize(kernel.reshape(K,
N).T, fmt, axis=-1, tile=tile)``: quantized along K, in the TN form the native GEMMs take. The
GEMM is weight-only (``activations=False``: the weight decoded to ``dtype`` inside the GEMM,
then a plain dot with float32 accumulation) or weight-and-activation (``activations=True``: the
activation quantized along K in the weight's format, 1-D blocks, and the product through
:func:`jaxmx.matmul`, native where the machine has the kernel). Forward only: a gradient through
it raises. The Flax ``quantize_weights`` layers compute through it.

Example:
    >>> import jax.numpy as jnp
    >>> w = store_weight(jnp.ones((64, 8)), "mxfp8_e4m3")
    >>> w.shape, w.axis
    ((8, 64), 1)
    >>> weight_matmul(jnp.ones((2, 64)), w).tolist()[0][:2]
    [64.0, 64.0]
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxmx._src.core.formats import Format, check_gemm_operand, get_format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.gemm.matmul import matmul
from jaxmx._src.quantize.quantize import dequantize, quantize


def store_weight(
    kernel: jax.Array,
    fmt: str | Format,
    *,
    tile: tuple[int, int] | None = None,
    contracting: int = 1,
) -> MXArray:
    """``kernel [*in, *out]`` stored as the ``[N, K]`` MXArray :func:`weight_matmul` takes.

    Args:
        kernel: a floating-point array whose first ``contracting`` dims are the ones a GEMM
            contracts (K is their product) and whose other dims are its outputs (N): a Dense
            layer's ``[K, N]`` kernel, a DenseGeneral's ``[*in, *out]``.
        fmt: a GEMM format of :data:`jaxmx.FORMATS` (``"mxfp8_e4m3"``, ``"mxfp4"``,
            ``"nvfp4"``, ``"fp8_e4m3_block"``, ...).
        tile: ``None`` (1-D blocks along K) or ``(rows, cols)``: one scale per tile of the
            ``[N, K]`` weight (NVFP4 ``(16, 16)``, block FP8 ``(128, 128)``).
        contracting: how many leading dims of ``kernel`` are contracted, from 1 to
            ``kernel.ndim``.

    Returns:
        ``quantize(kernel.reshape(K, N).T, fmt, axis=-1, tile=tile)``.

    Example:
        >>> import jax.numpy as jnp
        >>> w = store_weight(jnp.ones((4, 16, 8)), "mxfp8_e4m3", contracting=2)
        >>> w.shape, w.fmt
        ((8, 64), 'mxfp8_e4m3')
    """
    fmt = check_gemm_operand(get_format(fmt), "store_weight: fmt").name
    kernel = jnp.asarray(kernel)
    if isinstance(contracting, bool) or not isinstance(contracting, int):
        raise TypeError(f"store_weight: contracting must be an int, got {contracting!r}")
    if not 1 <= contracting <= kernel.ndim:
        raise ValueError(
            f"store_weight: contracting must be between 1 and the kernel's rank "
            f"{kernel.ndim} (shape {tuple(kernel.shape)}), got {contracting}"
        )
    k = math.prod(kernel.shape[:contracting])
    return quantize(kernel.reshape(k, -1).T, fmt, axis=-1, tile=tile)


def weight_matmul(
    x: jax.Array,
    w: MXArray,
    *,
    activations: bool = False,
    dtype=None,
) -> jax.Array:
    """``x [..., K]`` times the stored weight ``w [N, K]`` (:func:`store_weight`): ``[..., N]``.

    Forward only (inference): a gradient through it raises a TypeError.

    Args:
        x: a floating-point array whose last dim is K.
        w: the ``[N, K]`` MXArray of :func:`store_weight`, quantized along K (axis 1).
        activations: ``False``: weight-only (W8A16 / W4A16: ``w`` decoded to ``dtype``, a plain
            dot with float32 accumulation); ``True``: ``x`` is quantized along K in ``w``'s
            format too and the product runs through :func:`jaxmx.matmul` (W8A8 / W4A4).
        dtype: the floating-point dtype ``x`` is cast to and the result has; ``None``:
            ``x``'s dtype.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> w = store_weight(jnp.full((64, 8), 0.5), "mxfp8_e4m3")
        >>> x = jnp.ones((3, 5, 64), jnp.bfloat16)
        >>> y = weight_matmul(x, w, activations=True, dtype=jnp.float32)
        >>> y.shape, y.dtype, y[0, 0, 0].item()
        ((3, 5, 8), dtype('float32'), 32.0)
    """
    if not isinstance(w, MXArray):
        raise TypeError(
            f"weight_matmul: w must be the MXArray of jaxmx.store_weight, got {type(w).__name__}"
        )
    if w.ndim != 2 or w.axis != 1:
        raise ValueError(
            f"weight_matmul: w must be a 2-D [N, K] MXArray quantized along K (axis 1), as "
            f"jaxmx.store_weight makes it; got shape {tuple(w.shape)} quantized along axis "
            f"{w.axis}"
        )
    if not isinstance(activations, bool):
        raise TypeError(f"weight_matmul: activations must be a bool, got {activations!r}")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"weight_matmul: x must be a floating-point array, got {x.dtype} (cast it, e.g. "
            "x.astype(jnp.float32), or embed integer ids first)"
        )
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"weight_matmul: dtype must be floating point, got {dtype}")
    if x.ndim == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"weight_matmul: x [..., K] of shape {tuple(x.shape)} does not match the stored "
            f"weight [N, K] of shape {tuple(w.shape)}: x's last dim must be K = {w.shape[1]}"
        )
    y = _gemm(x.reshape(-1, w.shape[1]).astype(dtype), w, activations, dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gemm(x: jax.Array, w: MXArray, activations: bool, dtype) -> jax.Array:
    """``x [M, K] @ w [N, K]^T`` in ``dtype``."""
    if activations:
        return matmul(quantize(x, w.fmt, axis=-1), w, dtype)
    w_hat = dequantize(w, dtype)
    dims = (((1,), (1,)), ((), ()))
    return lax.dot_general(x, w_hat, dims, preferred_element_type=jnp.float32).astype(dtype)


def _gemm_fwd(x, w, activations, dtype):
    return _gemm(x, w, activations, dtype), None


def _gemm_bwd(activations, dtype, residuals, g):
    raise TypeError(
        "weight_matmul: a GEMM on weights at rest (jaxmx.store_weight, the Flax "
        "quantize_weights) is for inference (forward only) and has no gradient; train the "
        "original float weights (jaxmx.dot_general with a Recipe, or jaxmx.flax "
        "quantize_model for MX training), then store them"
    )


_gemm.defvjp(_gemm_fwd, _gemm_bwd)
