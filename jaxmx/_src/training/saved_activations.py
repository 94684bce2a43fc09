"""Activations saved for the backward pass in low precision: :func:`save_quantized`.

A function's backward pass needs its inputs (GELU's input, a norm's input, the input of a
Linear); autodiff keeps them in their own dtype between the forward and the backward pass.
:func:`save_quantized` wraps a function so that the inputs it names are kept quantized instead
(MXFP8, block FP8 in 1x128 blocks, or E5M6 with power-of-two scales per 128), and its backward
pass decodes them and differentiates the function there, recomputing its forward pass from the
decoded inputs, as ``jax.checkpoint`` recomputes from what it saved.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> gelu = jaxmx.save_quantized(jax.nn.gelu, "mxfp8_e4m3")
    >>> x = jnp.linspace(-2.0, 2.0, 64, dtype=jnp.float32)
    >>> bool((gelu(x) == jax.nn.gelu(x)).all())             # the forward pass is fn's
    True
    >>> g = jax.grad(lambda x: gelu(x).sum())(x)               # fn's gradient at the decoded x
    >>> x_hat = jaxmx.dequantize(jaxmx.quantize(x, "mxfp8_e4m3"))
    >>> bool((g == jax.grad(lambda x: jax.nn.gelu(x).sum())(x_hat)).all())
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmx._src.core.checks import normalize_axis
from jaxmx._src.core.dtypes import FLOAT_DTYPES
from jaxmx._src.core.formats import SAVE_FORMATS, Format, check_scale_mode, get_format
from jaxmx._src.core.mxarray import MXArray
from jaxmx._src.quantize.codec import codec_of
from jaxmx._src.quantize.quantize import dequantize, quantize

SAVED_QUANTIZED = "jaxmx_saved_quantized"
"""The ``checkpoint_name`` of the codes and scales :func:`save_quantized` keeps, for remat
policies (``jax.checkpoint_policies.save_only_these_names(jaxmx.SAVED_QUANTIZED)``)."""


def save_quantized(
    fn: Callable,
    fmt: str = "mxfp8_e4m3",
    *,
    argnums: int | tuple[int, ...] = 0,
    axis: int = -1,
    scale_mode: str | None = None,
) -> Callable:
    """``fn`` whose inputs ``argnums`` are saved for the backward pass quantized in ``fmt``.

    The wrapped function returns ``fn(*args)`` unchanged: the forward pass runs on the inputs
    as given. Only what is kept for the backward pass changes: instead of the inputs
    ``argnums`` (and whatever ``fn``'s own VJP would keep: its intermediates), the codes and
    scales of each such input are kept. The backward pass decodes them to the input's dtype
    and returns ``jax.vjp(fn, *decoded_args)``'s cotangents: ``fn``'s forward pass is
    recomputed from the decoded inputs (as under ``jax.checkpoint``), so the gradients are
    those of ``fn`` at ``dequantize(quantize(x))``. The other arguments (weights, a norm's
    scale) are kept as they are.

    Args:
        fn: a function of arrays (or pytrees of arrays) returning arrays; differentiable by
            JAX. May close over nothing traced (pass parameters as arguments).
        fmt: one of :data:`SAVE_FORMATS`: ``"mxfp8_e4m3"`` (default), ``"mxfp8_e5m2"``,
            ``"fp8_e4m3_block"``, ``"fp8_e5m2_block"``, ``"e5m6_block"`` (E5M6 codes, 12 bits
            each, packed two per three bytes; power-of-two float32 scales per 128 elements: a
            1x128 block re-laid out as 128x1 keeps its values, no second rounding).
        argnums: the positional argument(s) to save quantized: each a float32, bfloat16 or
            float16 array of rank >= 1.
        axis: the block axis of each saved input (default the last, the hidden dimension).
        scale_mode: the format's scale rule (``None``: its default, ``"rceil"`` for MXFP8,
            ``"fp32"`` for block FP8, ``"pow2"`` for E5M6).

    Returns:
        A function of the same arguments, differentiable in reverse mode (a ``jax.custom_vjp``:
        no forward-mode derivatives) and usable under ``jit``, ``vmap``, ``lax.scan`` and
        ``jax.checkpoint``. The saved codes and scales carry the ``checkpoint_name``
        :data:`SAVED_QUANTIZED`.

    Bytes kept per element of a bfloat16 input (2 bytes): MXFP8 1.03, block FP8 1.03, E5M6
    1.53.

    Example:
        >>> import jax, jax.numpy as jnp, jaxmx
        >>> def norm(x, w):
        ...     return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w
        >>> saved = jaxmx.save_quantized(norm, "e5m6_block")       # keeps x in 12 bits
        >>> x, w = jnp.ones((4, 128), jnp.bfloat16), jnp.ones(128, jnp.bfloat16)
        >>> dx, dw = jax.grad(lambda x, w: saved(x, w).sum(), argnums=(0, 1))(x, w)
        >>> dx.dtype, dw.shape
        (dtype(bfloat16), (128,))
    """
    f = _checked_format(fmt)
    scale_mode = check_scale_mode(scale_mode, f)
    argnums = _checked_argnums(argnums)
    if not callable(fn):
        raise TypeError(f"save_quantized: fn must be callable, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapped(*args):
        for i in argnums:
            if i >= len(args):
                raise ValueError(
                    f"save_quantized: argnums {argnums} names argument {i}, but "
                    f"{getattr(fn, '__name__', 'fn')} got {len(args)} positional arguments"
                )
        inputs = tuple(_checked_input(args[i], i) for i in argnums)
        others = tuple(None if i in argnums else a for i, a in enumerate(args))
        like = tuple((x.shape, x.dtype, normalize_axis(axis, x.ndim)) for x in inputs)

        def call(inputs, others):
            merged = list(others)
            for i, x in zip(argnums, inputs, strict=True):
                merged[i] = x
            return fn(*merged)

        @jax.custom_vjp
        def run(inputs, others):
            return call(inputs, others)

        def forward(inputs, others):
            axes = (a for _, _, a in like)
            saved = tuple(_saved(x, f, a, scale_mode) for x, a in zip(inputs, axes, strict=True))
            return call(inputs, others), (saved, others)

        def backward(residuals, cotangent):
            saved, others = residuals
            decoded = tuple(_decoded(s, f, *facts) for s, facts in zip(saved, like, strict=True))
            _, vjp = jax.vjp(call, decoded, others)
            return vjp(cotangent)

        run.defvjp(forward, backward)
        return run(inputs, others)

    return wrapped


def _checked_format(fmt) -> Format:
    if not isinstance(fmt, str) or fmt not in SAVE_FORMATS:
        raise ValueError(
            f"save_quantized: fmt {fmt!r} is not a format activations are saved in; expected "
            f"one of {SAVE_FORMATS}"
        )
    return get_format(fmt)


def _checked_argnums(argnums) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else argnums
    if (
        not isinstance(nums, tuple)
        or not nums
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in nums)
        or len(set(nums)) != len(nums)
    ):
        raise ValueError(
            f"save_quantized: argnums must be a non-negative int or a tuple of distinct ones, "
            f"got {argnums!r}"
        )
    return nums


def _checked_input(x, i: int) -> jax.Array:
    dtype = getattr(x, "dtype", None)
    if dtype is None or jnp.dtype(dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"save_quantized: argument {i} (in argnums) must be a float32, bfloat16 or float16 "
            f"array, got {type(x).__name__} of dtype {dtype}"
        )
    if jnp.ndim(x) == 0:
        raise ValueError(f"save_quantized: argument {i} (in argnums) is a scalar; nothing to save")
    return jnp.asarray(x)


def _saved(x, f: Format, axis: int, scale_mode: str) -> tuple[jax.Array, jax.Array]:
    """The codes (as unsigned integers; E5M6 packed) and scales kept for ``x``."""
    q = quantize(x, f.name, axis=axis, scale_mode=scale_mode)
    codes = codec_of(f).as_bytes(q.data)
    return checkpoint_name(codes, SAVED_QUANTIZED), checkpoint_name(q.scale, SAVED_QUANTIZED)


def _decoded(saved, f: Format, shape, dtype, axis: int) -> jax.Array:
    codes, scale = saved
    padded = list(shape)
    padded[axis] = scale.shape[axis] * f.block
    data = codec_of(f).from_bytes(codes, f, tuple(padded))
    q = MXArray(data=data, scale=scale, fmt=f.name, axis=axis, shape=tuple(shape))
    return dequantize(q, dtype)
