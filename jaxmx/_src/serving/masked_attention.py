"""The masks, softmax and ``P V`` of :func:`jaxmx.cached_attention`, with float semantics for
non-finite values: a masked key contributes nothing whatever its bits (a fresh or reused page,
a future token under causality), a visible NaN or inf propagates as in float attention.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxmx._src.serving.masked_attention import masked_softmax, visible_keys
    >>> visible = visible_keys(jnp.array([2]), 1, 3, True)          # [batch, t, max_len]
    >>> p = masked_softmax(jnp.array([[[0.0, 0.0, jnp.nan]]]), visible)
    >>> p.tolist()                                   # the NaN logit is masked: no effect
    [[[0.5, 0.5, 0.0]]]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def visible_keys(length: jax.Array, t: int, max_len: int, is_causal: bool) -> jax.Array:
    """``[batch, t, max_len]``: key j is visible to query i (j < length, and with ``is_causal``
    j <= length - t + i)."""
    key = jnp.arange(max_len, dtype=jnp.int32)[None, None, :]
    visible = key < length[:, None, None]
    if is_causal:
        query = length[:, None, None] - t + jnp.arange(t, dtype=jnp.int32)[None, :, None]
        visible = visible & (key <= query)
    return visible


def masked_softmax(logits: jax.Array, visible: jax.Array) -> jax.Array:
    """Float32 softmax over the last axis of the visible logits. A row with no visible key is
    0; a visible NaN or ``+inf`` logit makes its row NaN (as float attention), masked logits
    are ignored whatever their value."""
    any_visible = jnp.any(visible, axis=-1, keepdims=True)
    logits = jnp.where(visible, logits, -jnp.inf)
    top = jnp.where(any_visible, jnp.max(logits, axis=-1, keepdims=True), 0.0)
    e = jnp.where(visible, jnp.exp(logits - top), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return jnp.where(any_visible, e / jnp.where(any_visible, total, 1.0), 0.0)


def masked_pv(p: jax.Array, visible: jax.Array, v: jax.Array) -> jax.Array:
    """``sum_j p[.., t, j] v[.., j, :]`` over the visible keys only: ``p`` ``[b, k, g, t, s]``
    (0 where masked), ``visible`` broadcastable to it, ``v`` ``[b, k, s, d]`` float32; returns
    ``[b, t, k, g, d]`` float32.

    A masked V (NaN or inf bits beyond a length or at a future position) adds nothing; a
    visible non-finite V gives what float attention gives: NaN for a NaN, for ``+inf`` and
    ``-inf`` together, or for an inf whose probability is 0; ``+-inf`` otherwise. The all-finite
    case is one float32 dot; the non-finite one (a ``lax.cond``) counts the visible non-finite
    values per output element with five more dots.
    """
    finite = jnp.isfinite(v)
    out = _dot(p, jnp.where(finite, v, 0.0))
    visible = jnp.broadcast_to(visible, p.shape)
    return lax.cond(
        jnp.all(finite), lambda: out, lambda: _with_non_finite(out, p, visible, v, finite)
    )


def _with_non_finite(out, p, visible, v, finite):
    kinds = jnp.stack([jnp.isnan(v), v == jnp.inf, v == -jnp.inf]).astype(jnp.float32)
    nan = _dot(visible.astype(jnp.float32), kinds[0]) > 0
    weighted = [_dot((p > 0).astype(jnp.float32), kind) > 0 for kind in kinds[1:]]
    lost = [_dot((visible & (p <= 0)).astype(jnp.float32), kind) > 0 for kind in kinds[1:]]
    out = out + jnp.where(weighted[0], jnp.inf, 0.0) + jnp.where(weighted[1], -jnp.inf, 0.0)
    return jnp.where(nan | lost[0] | lost[1], jnp.nan, out)


def _dot(p, v):
    return jnp.einsum(
        "bkgts,bksd->btkgd",
        p,
        v,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
