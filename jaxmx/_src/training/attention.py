"""``jaxmx.dot_product_attention``: multi-head attention whose two products are jaxmx GEMMs.

The semantics and layouts of ``jax.nn.dot_product_attention``: ``query [B, T, N, H]``,
``key`` / ``value [B, S, K, H]`` with ``N`` a multiple of ``K`` (grouped-query attention when
``K < N``), an optional ``bias`` added to the logits and a boolean ``mask`` (True keeps),
``is_causal``, and ``scale`` (default ``1 / sqrt(H)``). ``Q K^T`` contracts H and ``P V``
contracts S through :func:`jaxmx.dot_general`, so in the forward and both backward passes every
operand is quantized along the axis its GEMM reduces; the softmax runs in float32.

Example:
    >>> import jax, jax.numpy as jnp, jaxmx
    >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 32))
    >>> kv = jax.random.normal(jax.random.key(1), (2, 16, 2, 32))     # 2 KV heads: GQA
    >>> jaxmx.dot_product_attention(q, kv, kv, is_causal=True).shape
    (2, 16, 4, 32)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxmx._src.core.dtypes import as_float_array
from jaxmx._src.core.recipes import MXFP8, Recipe, check_recipe
from jaxmx._src.training.einsum import einsum
from jaxmx._src.training.scope import named

PRODUCTS = ("qk", "pv")
"""The names of the two products (:func:`jaxmx.diagnostics.named`), under the caller's name."""


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    recipe: Recipe | None = MXFP8,
) -> jax.Array:
    """``softmax(scale * Q K^T + bias, masked) V`` with both products in MX formats.

    Args:
        query: ``[B, T, N, H]`` (or ``[T, N, H]``).
        key, value: ``[B, S, K, H]`` (or ``[S, K, H]``); ``N % K == 0``.
        bias: added to the logits, broadcastable to ``[B, N, T, S]``.
        mask: boolean, broadcastable to ``[B, N, T, S]``; False entries are masked out.
        scale: the logits' scale; default ``1 / sqrt(H)``.
        is_causal: also mask out keys after each query (``tril`` over ``[T, S]``).
        recipe: the :class:`jaxmx.Recipe` of both products, or ``None``: both in plain high
            precision.

    Returns:
        ``[B, T, N, H]`` (or ``[T, N, H]``) in ``query``'s dtype.
    """
    check_recipe(recipe, "jaxmx.dot_product_attention", optional=True)
    query = as_float_array(query, "dot_product_attention: query")
    key = as_float_array(key, "dot_product_attention: key")
    value = as_float_array(value, "dot_product_attention: value")
    if query.ndim == 3:
        args = [query[None], key[None], value[None], bias, mask]
        out = dot_product_attention(*args, scale=scale, is_causal=is_causal, recipe=recipe)
        return out[0]
    _check_shapes(query, key, value)
    b, t, n, h = query.shape
    s, k = key.shape[1], key.shape[2]
    g = n // k
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    grouped = query.reshape(b, t, k, g, h)
    with named(PRODUCTS[0]):
        logits = einsum(
            "btkgh,bskh->bkgts", grouped, key, recipe=recipe, preferred_element_type=jnp.float32
        )
    logits = logits * jnp.float32(scale)
    if bias is not None:
        logits = logits + _grouped(jnp.asarray(bias, jnp.float32), b, k, g, t, s)
    keep = _keep(mask, is_causal, b, k, g, t, s)
    if keep is not None:
        logits = jnp.where(keep, logits, jnp.float32(-0.7) * jnp.finfo(jnp.float32).max)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    with named(PRODUCTS[1]):
        out = einsum("bkgts,bskh->btkgh", probs, value, recipe=recipe)
    return out.reshape(b, t, n, h).astype(query.dtype)


def _check_shapes(query, key, value) -> None:
    if query.ndim != 4 or key.ndim != 4 or value.shape != key.shape:
        raise ValueError(
            "dot_product_attention: query must be [B, T, N, H] and key, value [B, S, K, H] (the "
            f"same shape), got query {query.shape}, key {key.shape}, value {value.shape}"
        )
    (b, _, n, h), (bk, _, k, hk) = query.shape, key.shape
    if b != bk or h != hk or n % k:
        raise ValueError(
            "dot_product_attention: query [B, T, N, H] and key [B, S, K, H] need the same B and "
            f"H and N a multiple of K, got query {query.shape} and key {key.shape}"
        )


def _grouped(x: jax.Array, b: int, k: int, g: int, t: int, s: int) -> jax.Array:
    """A ``[B, N, T, S]``-broadcastable array as ``[B, K, G, T, S]``."""
    x = jnp.broadcast_to(x, (b, k * g, t, s))
    return x.reshape(b, k, g, t, s)


def _keep(mask, is_causal: bool, b: int, k: int, g: int, t: int, s: int):
    keep = None
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"dot_product_attention: mask must be boolean, got {mask.dtype}")
        keep = _grouped(mask, b, k, g, t, s)
    if is_causal:
        causal = jnp.tril(jnp.ones((t, s), jnp.bool_))
        keep = causal if keep is None else keep & causal
    return keep
