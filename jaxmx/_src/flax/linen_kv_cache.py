"""linen: decode with a :class:`jaxmx.KVCache` in ``nn.MultiHeadDotProductAttention`` layers.

A linen ``MultiHeadDotProductAttention(decode=True)`` writes its projected K and V into its own
high-precision ``cached_key`` / ``cached_value`` before its ``attention_fn`` runs, so no hook
keeps the cache quantized. Inside :func:`kv_cache` (a context manager, like
:func:`jaxmx.flax.linen.quantize_model`'s interception, ``nn.intercept_methods``) each such
layer's call is run by :func:`decode_call` instead: the same projections (the same parameters,
under the same names), with the ``"cache"`` collection holding ``kv_cache`` (a
``jaxmx.KVCache``) and ``cache_index`` in place of ``cached_key`` / ``cached_value``. As with
Flax's own cache, ``init`` with a full-length input sizes the cache (batch and ``max_len`` from
the input), then each ``apply(..., mutable=["cache"])`` takes the next tokens.

Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import jaxmx.flax.linen as mxl
    >>> layer = nn.MultiHeadDotProductAttention(num_heads=2, decode=True)
    >>> with mxl.kv_cache():
    ...     variables = layer.init(jax.random.key(0), jnp.ones((1, 16, 64)))
    ...     y, state = layer.apply(variables, jnp.ones((1, 1, 64)), mutable=["cache"])
    >>> y.shape, int(state["cache"]["cache_index"])
    ((1, 1, 64), 1)
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxmx._src.serving.kv_cache import KVCache, cached_attention, checked_format


@contextlib.contextmanager
def kv_cache(*, fmt: str = "mxfp8_e4m3", page_size: int | None = None):
    """Within this block, every ``nn.MultiHeadDotProductAttention`` with ``decode=True`` keeps
    a ``jaxmx.KVCache`` (``fmt``, ``page_size`` as :meth:`jaxmx.KVCache.create`) in its
    ``"cache"`` collection and attends with :func:`jaxmx.cached_attention`
    (:func:`decode_call`). Use it around ``init`` and every ``apply`` of the decoding model.

    Example:
        >>> import jaxmx.flax.linen as mxl
        >>> with mxl.kv_cache(fmt="bf16"):
        ...     pass
        Traceback (most recent call last):
        ...
        ValueError: KVCache.create: unknown fmt 'bf16'; ...
    """
    checked_format(fmt)

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if (
            context.method_name == "__call__"
            and isinstance(module, nn.MultiHeadDotProductAttention)
            and module.decode
        ):
            return decode_call(module, *args, fmt=fmt, page_size=page_size, **kwargs)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(intercept):
        yield


def decode_call(
    module: nn.MultiHeadDotProductAttention,
    inputs_q,
    inputs_k=None,
    inputs_v=None,
    *,
    fmt: str,
    page_size: int | None,
    inputs_kv=None,
    mask=None,
    deterministic=None,
    dropout_rng=None,
    sow_weights: bool = False,
):
    """The decode call of the bound ``module`` over an MX cache (what :func:`kv_cache` runs).

    The first call (``init``) creates the cache for ``inputs_q``'s batch and length and returns
    the layer's ordinary attention (its ``attention_fn``, as Flax's first call does); later
    calls write the new tokens at ``cache_index``, run :func:`jaxmx.cached_attention` (causal,
    ``length = cache_index + new_len``) and advance ``cache_index``. ``inputs_kv``, a ``mask``,
    ``sow_weights`` or active dropout are refused (a ValueError).
    """
    _check_decode_call(module, inputs_kv, mask, sow_weights, deterministic)
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    query, key, value = _projections(module, inputs_q, inputs_k, inputs_v)
    initialized = module.has_variable("cache", "kv_cache")
    batch, max_len, heads, head_dim = key.shape
    cache = module.variable(
        "cache",
        "kv_cache",
        functools.partial(KVCache.create, fmt=fmt, page_size=page_size),
        batch,
        max_len,
        heads,
        head_dim,
    )
    index = module.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if not initialized and not module.is_initializing():
        raise ValueError(
            f"jaxmx.flax.linen.kv_cache: {_layer(module.scope.path)} has no "
            "jaxmx.KVCache in its 'cache' collection: its variables were made by an init "
            "outside `with jaxmx.flax.linen.kv_cache():` (or without the 'cache' collection); "
            "run init inside it too"
        )
    if not initialized:
        for name in ("cached_key", "cached_value"):  # Flax's own decode path trips on these
            module.variable("cache", name, OutsideKVCacheContext, tuple(module.scope.path))
        x = _stock_attention(module, query, key, value)
    else:
        new = cache.value.update(key, value, index.value)
        x = cached_attention(query, new, length=index.value + query.shape[1])
        cache.value, index.value = new, index.value + query.shape[1]
    return _out(module, inputs_q, x)


@jax.tree_util.register_pytree_node_class
class OutsideKVCacheContext:
    """What a layer decoding over a ``jaxmx.KVCache`` holds as Flax's ``cached_key`` /
    ``cached_value``: a pytree without leaves whose ``shape`` (the first thing Flax's own decode
    step reads) raises, so an ``apply`` outside :func:`kv_cache` says so instead of caching the
    current token alone (or failing on a missing ``cached_key``).

    Example:
        >>> OutsideKVCacheContext(("decoder", "attn")).shape
        Traceback (most recent call last):
        ...
        ValueError: jaxmx.flax.linen.kv_cache: the layer 'decoder/attn' decodes over a ...
    """

    def __init__(self, path: tuple[str, ...] = ()):
        self.path = tuple(path)

    @property
    def shape(self):
        raise ValueError(
            f"jaxmx.flax.linen.kv_cache: {_layer(self.path)} decodes over a "
            "jaxmx.KVCache ('cache' collection: kv_cache, cache_index) but this apply runs "
            "outside `with jaxmx.flax.linen.kv_cache():`, so Flax's own decode step ran; run "
            "every apply of the decoding model inside it (with the fmt and page_size of init)"
        )

    def tree_flatten(self):
        return (), self.path

    @classmethod
    def tree_unflatten(cls, path, children):
        return cls(path)

    def __repr__(self) -> str:
        return f"OutsideKVCacheContext({'/'.join(self.path)!r})"


def _layer(path) -> str:
    return f"the layer {'/'.join(path)!r}" if path else "the top-level layer"


def _projections(module, inputs_q, inputs_k, inputs_v):
    """Query, key, value as Flax's layer projects them (the same submodules and names)."""
    qkv_features = module.qkv_features or inputs_q.shape[-1]
    if qkv_features % module.num_heads:
        raise ValueError(
            f"MultiHeadDotProductAttention: qkv_features {qkv_features} is not a multiple of "
            f"num_heads {module.num_heads}"
        )
    dense = functools.partial(
        nn.DenseGeneral,
        axis=-1,
        dtype=module.dtype,
        param_dtype=module.param_dtype,
        features=(module.num_heads, qkv_features // module.num_heads),
        kernel_init=module.kernel_init,
        bias_init=module.bias_init,
        use_bias=module.use_bias,
        precision=module.precision,
        dot_general=module.qkv_dot_general,
        dot_general_cls=module.qkv_dot_general_cls,
    )
    query = dense(name="query")(inputs_q)
    key, value = dense(name="key")(inputs_k), dense(name="value")(inputs_v)
    if module.normalize_qk:
        norm = functools.partial(
            nn.LayerNorm, use_bias=False, dtype=module.dtype, param_dtype=module.param_dtype
        )
        query, key = norm(name="query_ln")(query), norm(name="key_ln")(key)
    return query, key, value


def _stock_attention(module, query, key, value):
    kwargs = dict(dtype=module.dtype, precision=module.precision, deterministic=True)
    accepted = inspect.signature(module.attention_fn).parameters
    return module.attention_fn(
        query, key, value, **{k: v for k, v in kwargs.items() if k in accepted}
    )


def _out(module, inputs_q, x):
    return nn.DenseGeneral(
        features=module.out_features or inputs_q.shape[-1],
        axis=(-2, -1),
        kernel_init=module.out_kernel_init or module.kernel_init,
        bias_init=module.out_bias_init or module.bias_init,
        use_bias=module.use_bias,
        dtype=module.dtype,
        param_dtype=module.param_dtype,
        precision=module.precision,
        dot_general=module.out_dot_general,
        dot_general_cls=module.out_dot_general_cls,
        name="out",
    )(x)


def _check_decode_call(module, inputs_kv, mask, sow_weights: bool, deterministic) -> None:
    where = "jaxmx.flax.linen.kv_cache"
    if inputs_kv is not None:
        raise ValueError(f"{where}: pass inputs_k / inputs_v, not the deprecated inputs_kv")
    if mask is not None:
        raise ValueError(
            f"{where}: decode takes no mask (the cache's lengths and causality mask it)"
        )
    if sow_weights:
        raise ValueError(f"{where}: decode cannot sow attention weights")
    active = module.deterministic if deterministic is None else deterministic
    if module.dropout_rate > 0.0 and active is False:
        raise ValueError(f"{where}: decode runs without dropout; pass deterministic=True")
