"""nnx: decode with a :class:`jaxmx.KVCache` in ``nnx.MultiHeadAttention`` layers.

``nnx.MultiHeadAttention`` writes its projected K and V into its own high-precision
``cached_key`` / ``cached_value`` before its ``attention_fn`` runs, and calls that function with
no handle on the module, so no hook can keep the cache quantized. :func:`init_kv_cache` takes the
place of each layer's ``init_cache``: it makes the layer a :class:`KVCacheAttention` (a subclass
with the same parameters and non-decode behaviour) whose decode step keeps a ``jaxmx.KVCache`` in
the ``nnx.Cache`` ``kv_cache`` (``cached_key`` / ``cached_value`` are dropped) and advances
``cache_index``, as Flax's does.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jaxmx.flax.nnx as mxnnx
    >>> layer = nnx.MultiHeadAttention(2, 64, decode=True, rngs=nnx.Rngs(0))
    >>> mxnnx.init_kv_cache(layer, batch=1, max_len=16)
    ['.']
    >>> layer(jnp.ones((1, 1, 64))).shape, int(layer.cache_index[...])
    ((1, 1, 64), 1)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxmx._src.serving.kv_cache import KVCache, cached_attention, checked_format


class KVCacheAttention(nnx.MultiHeadAttention):
    """``nnx.MultiHeadAttention`` whose decode step reads and writes a ``jaxmx.KVCache``.

    Made by :func:`init_kv_cache` from an existing layer (never constructed directly). Outside
    decode it is the stock layer. In decode, a call takes ``new_len >= 1`` tokens (a prefill
    chunk or one token), writes their K and V at ``cache_index``, runs
    :func:`jaxmx.cached_attention` (causal, ``length = cache_index + new_len``) and advances
    ``cache_index`` by ``new_len``. A ``mask``, ``sow_weights`` or active dropout in decode is
    refused (a ValueError): the cache's lengths are the only mask.
    """

    def __call__(
        self,
        inputs_q,
        inputs_k=None,
        inputs_v=None,
        *,
        mask=None,
        deterministic=None,
        rngs=None,
        sow_weights=False,
        decode=None,
        **kwargs,
    ):
        decode = self.decode if decode is None else decode
        if not decode:
            return super().__call__(
                inputs_q, inputs_k, inputs_v, mask=mask, deterministic=deterministic,
                rngs=rngs, sow_weights=sow_weights, decode=False, **kwargs,
            )  # fmt: skip
        _check_decode_call(self, mask, sow_weights, deterministic)
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        query, key, value = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
        if self.normalize_qk:
            query, key = self.query_ln(query), self.key_ln(key)
        index = self.cache_index[...]
        cache = self.kv_cache.get_value().update(key, value, index)
        x = cached_attention(query, cache, length=index + query.shape[1])
        self.kv_cache.set_value(cache)
        self.cache_index[...] = index + query.shape[1]
        return self.out(x)


def init_kv_cache(
    model: nnx.Module,
    batch: int,
    max_len: int,
    *,
    fmt: str = "mxfp8_e4m3",
    page_size: int | None = None,
) -> list[str]:
    """Gives every ``nnx.MultiHeadAttention`` of ``model`` an MX KV cache, in place.

    Call it instead of the layers' ``init_cache``: each layer becomes a
    :class:`KVCacheAttention` holding ``kv_cache``, an empty ``jaxmx.KVCache.create(batch,
    max_len, num_kv_heads, head_dim, fmt=fmt, page_size=page_size)``, and ``cache_index`` 0.
    Calling it again empties the caches. Returns the converted layers' ``/``-joined paths
    (``"."`` for ``model`` itself); a model without such a layer is a ValueError.

    Example:
        >>> from flax import nnx
        >>> import jaxmx.flax.nnx as mxnnx
        >>> layer = nnx.MultiHeadAttention(4, 128, num_kv_heads=2, rngs=nnx.Rngs(0))
        >>> mxnnx.init_kv_cache(layer, 2, 64, page_size=32)
        ['.']
        >>> layer.kv_cache.get_value().k_codes.shape   # 2 x 2 pages of 32 tokens, 2 KV heads
        (4, 2, 32, 32)
    """
    checked_format(fmt)
    layers = [
        (path, m) for path, m in nnx.iter_graph(model) if isinstance(m, nnx.MultiHeadAttention)
    ]
    if not layers:
        raise ValueError("init_kv_cache: the model has no nnx.MultiHeadAttention layer")
    for _, layer in layers:
        cache = KVCache.create(
            batch, max_len, layer.num_kv_heads, layer.head_dim, fmt=fmt, page_size=page_size
        )
        layer.__class__ = KVCacheAttention
        layer.cached_key = layer.cached_value = nnx.data(None)
        layer.kv_cache = nnx.Cache(cache)
        layer.cache_index = nnx.Cache(jnp.array(0, jnp.int32))
    return ["/".join(str(p) for p in path) or "." for path, _ in layers]


def _check_decode_call(layer, mask, sow_weights: bool, deterministic) -> None:
    if mask is not None:
        raise ValueError(
            "KVCacheAttention: decode takes no mask (the cache's lengths and causality mask it)"
        )
    if sow_weights:
        raise ValueError("KVCacheAttention: decode cannot sow attention weights")
    active = deterministic if deterministic is not None else layer.deterministic
    if layer.dropout_rate > 0.0 and active is False:
        raise ValueError("KVCacheAttention: decode runs without dropout; pass deterministic=True")
    if not isinstance(layer.kv_cache.get_value(), KVCache):
        raise ValueError("KVCacheAttention: no cache; call jaxmx.flax.nnx.init_kv_cache first")
